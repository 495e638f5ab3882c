"""A re-cut's next stage on a worker, started while the old one serves (`stage --prepared FILE`).

The process restores its layers and compiles its steps, writes FILE and opens no port until SIGUSR1
(stage/loop.hold_until_go). The worker says PREPARED once FILE is there, so the driver pauses the
engine only for the switch itself: HALT stops the old stage (its ports free), START sends the go,
and the new stage binds and says READY at once, instead of restoring and compiling during the pause
(measured before: 39 s restoring 3 layers and the head on a host at 25% of a core, 57 s paused).
The cost: for that while the host holds both stages' weights.
"""

from __future__ import annotations

import dataclasses
import signal
import subprocess
from pathlib import Path

from skippy_zmq.ops.lifetime import STOP_GRACE_S


@dataclasses.dataclass
class NextStage:
    stage_id: str
    proc: subprocess.Popen
    prepared: Path          # the file the stage writes once built

    def ready(self) -> bool:
        return self.proc.poll() is None and self.prepared.exists()

    def failed(self) -> bool:
        return self.proc.poll() is not None

    def go(self) -> subprocess.Popen:
        """Let it open its ports (the old stage has stopped); it serves from here."""
        self.proc.send_signal(signal.SIGUSR1)
        return self.proc

    def cancel(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_GRACE_S + 2)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
