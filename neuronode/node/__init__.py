"""The running process: start-up, the daemon loop, rounds, catch-up, the trainer, checkpoints,
status, metrics and console output."""
