import sys
from pathlib import Path

# Test helpers (procutil, plugin_task_example) live beside the tests.
sys.path.insert(0, str(Path(__file__).resolve().parent))
