"""Pipelines: schedules as data, the one interpreter, its transports (mailboxes, point-to-point), the threaded
engine."""
