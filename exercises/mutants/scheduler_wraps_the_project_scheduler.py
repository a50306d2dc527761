"""Mutant (exercise 7), a wrapper: the project's scheduler as shipped (``exercises/project_scheduler.py``, the
engine's continuous batching unchanged) in place of one written here. Right wherever the engine's scheduler is the
reference; in a student release it is built over exercise 7 itself, so it must fail there."""
from exercises.project_scheduler import ProjectScheduler


class Scheduler(ProjectScheduler):           # BUG: the engine's scheduler, through the project's
    pass
