"""Training tasks: the plug-in interface and the built-in byte-level LM. No networking here."""

from neuronode.training.task import (
    BUILTIN_TASKS,
    StatefulIterator,
    Task,
    TaskConfig,
    TaskError,
    TaskFactory,
    create_task,
    load_task,
)

__all__ = [
    "BUILTIN_TASKS",
    "StatefulIterator",
    "Task",
    "TaskConfig",
    "TaskError",
    "TaskFactory",
    "create_task",
    "load_task",
]
