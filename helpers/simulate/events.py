"""The discrete-event core: tasks on in-order streams, messages on links that carry one message at a time.

Why this shape: a GPU runs the kernels of one CUDA stream in the order they were issued, NCCL runs the collectives
of one communicator in the order every rank issued them, and (in this model) one direction of a link carries one
message at a time. So a task is: a duration, the streams it runs on (in the order tasks were added to each), the
link directions it holds while it runs, and the tasks it waits for. A collective sits on every participant's
stream, so it starts when all of them reach it. Links are granted first come, first served, in the order messages
became ready (ties: the order they were added); a message waiting for a link blocks later messages on that link.

Devices that are not hardware of their own (the CPU rig: each virtual device is a thread or process on a shared pool
of cores) run with `sharing` (`helpers.hardware.SharedCores`): the tasks that need a core then progress at
the speed the pool gives them, which changes whenever a task starts or ends (processor sharing).
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Hashable, Iterable

from helpers.timeline import Event


@dataclass
class Task:
    duration: float
    streams: tuple[Hashable, ...]
    links: tuple[Hashable, ...]
    after: tuple[int, ...]
    kind: str
    devices: tuple[int, ...]  # rows of the timeline that show this task
    microbatch: int | None
    stage: int | None = None  # the pipeline stage it belongs to, where a device holds several
    start: float = math.nan
    end: float = math.nan


@dataclass
class TaskGraph:
    tasks: list[Task] = field(default_factory=list)
    _last_on_stream: dict[Hashable, int] = field(default_factory=dict)

    def add(self, duration: float, streams: Iterable[Hashable], kind: str, devices: Iterable[int],
            after: Iterable[int | None] = (), links: Iterable[Hashable] = (), microbatch: int | None = None,
            stage: int | None = None) -> int:
        """Add a task after everything already on its streams and after `after` (None entries are ignored);
        returns its id."""
        if not (duration >= 0 and math.isfinite(duration)):
            raise ValueError(f"a {kind} task needs a finite duration >= 0, got {duration}")
        streams = tuple(streams)
        deps = {a for a in after if a is not None}
        deps.update(self._last_on_stream[s] for s in streams if s in self._last_on_stream)
        task_id = len(self.tasks)
        if any(not 0 <= d < task_id for d in deps):
            raise ValueError(f"a {kind} task can only wait for tasks added before it")
        self.tasks.append(Task(float(duration), streams, tuple(links), tuple(sorted(deps)), kind, tuple(devices),
                               microbatch, stage))
        for s in streams:
            self._last_on_stream[s] = task_id
        return task_id

    def run(self, sharing=None) -> float:
        """Give every task its start and end; return the makespan. With `sharing` (a `SharedCores`), the tasks of
        `sharing.kinds` share `sharing.cores` cores: each running task of those kinds occupies one core per device it
        runs on; while `users` such occupants want cores, each progresses at min(1, cores / users) of its own speed,
        divided by `sharing.slowdown` while more than one core is busy. Other tasks (links, copy engines), and every
        task without `sharing`, keep their own speed."""
        n = len(self.tasks)
        waiting = [len(t.after) for t in self.tasks]
        dependants: list[list[int]] = [[] for _ in self.tasks]
        for i, t in enumerate(self.tasks):
            for d in t.after:
                dependants[d].append(i)
        ready = [(0.0, i) for i in range(n) if waiting[i] == 0]
        heapq.heapify(ready)
        remaining: dict[int, float] = {}
        holder: dict[Hashable, int] = {}
        now, finished = 0.0, 0
        weight = [len(t.devices) if sharing is not None and t.kind in sharing.kinds else 0 for t in self.tasks]
        while ready or remaining:
            blocked, claimed = [], set()
            while ready:
                ready_at, i = heapq.heappop(ready)
                task = self.tasks[i]
                if any(lk in holder or lk in claimed for lk in task.links):
                    blocked.append((ready_at, i))
                    claimed.update(task.links)  # first come, first served: later messages queue behind it
                    continue
                task.start = now
                remaining[i] = task.duration
                for lk in task.links:
                    holder[lk] = i
            for item in blocked:
                heapq.heappush(ready, item)
            if not remaining:
                break
            users = sum(weight[i] for i in remaining)
            shared = min(1.0, sharing.cores / users) / (sharing.slowdown if min(users, sharing.cores) > 1 else 1.0) \
                if users else 1.0
            rate = {i: shared if weight[i] else 1.0 for i in remaining}
            dt = min(remaining[i] / rate[i] for i in remaining)
            now += dt
            done = [i for i in remaining if remaining[i] / rate[i] <= dt * (1 + 1e-12)]
            for i in remaining:
                remaining[i] -= rate[i] * dt
            for i in done:
                del remaining[i]
                task = self.tasks[i]
                task.end = now
                finished += 1
                for lk in task.links:
                    del holder[lk]
                for j in dependants[i]:
                    waiting[j] -= 1
                    if waiting[j] == 0:
                        heapq.heappush(ready, (now, j))
        if finished != n:
            stuck = [f"{t.kind} (devices {list(t.devices)})" for t, w in zip(self.tasks, waiting) if w > 0][:5]
            raise ValueError(f"the task graph deadlocks: {', '.join(stuck)} wait for tasks that never end")
        return max((t.end for t in self.tasks), default=0.0)

    def events(self) -> list[Event]:
        """The timeline in `helpers.timeline`'s format: one event per task and device, empty tasks left out."""
        return sorted((Event(d, t.kind, t.start, t.end, t.microbatch, t.stage)
                       for t in self.tasks if t.duration > 0 for d in t.devices),
                      key=lambda e: (e.device, e.start, e.end))
