"""A colocated worker: one engine does both phases (prefill chunks share steps with decodes).

It is neither role of the disaggregated pair: it runs the same requests as a prefill/decode pair and
streams the same StepOutputs, so the router can compare the two architectures on the same hardware.
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

from pdserve.config import EngineConfig
from pdserve.engine.scheduler_types import Role, ScheduledStep
from pdserve.serving.calls import Call
from pdserve.serving.messages import PrefillTask
from pdserve.serving.worker import WorkerActor, new_request


class ColocatedActor(WorkerActor):
    """Wrapped with ray.remote by the router's pool (which sets its resources)."""

    pool = "colocated"
    role = Role.COLOCATED

    def __init__(self, worker_id: str, config: EngineConfig, torch_threads: int | None = None, placement=None):
        super().__init__(worker_id, config, torch_threads, placement=placement)
        self._start()

    def handlers(self) -> dict[str, Callable]:
        return {**super().handlers(), Call.GENERATE.value: self._generate}

    def _generate(self, task: PrefillTask) -> Future[None]:
        """Call.GENERATE: queue a whole request; its tokens (the first one included) go out with the step
        outputs on the link; the future resolves once it is queued."""
        req = new_request(self.core, task)

        def add() -> None:
            if not self._cancelled_already(task.request_id):  # else its attempt is over
                self.core.scheduler.add(req)

        return self.loop.call(add)

    def _step(self) -> bool:
        if self.core.scheduler.must_resolve:  # pipelined: a structured output's next mask needs its last token here
            self._publish(*self._run(ScheduledStep([], [], [])))
        step = self.core.scheduler.schedule()
        if not step.chunks and not self.core.scheduler.launched:
            return False
        self._publish(*self._run(step))
        return True
