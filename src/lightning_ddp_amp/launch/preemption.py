"""The process's one SIGTERM (and, under ``auto_resume``, SIGINT) watcher, shared by every strategy and by both
Lightning flavours.

A signal has one handler per process, so its state lives here once (:data:`PREEMPTION`). This module imports
nothing from Lightning: ``lightning_ddp_amp.pytorch_lightning`` shares it instead of copying it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

#: The exit status of a run stopped by SIGTERM.
PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM
#: The exit status of a run that Ctrl-C (SIGINT) stopped after saving, as a shell reports a Ctrl-C.
INTERRUPTED_EXIT_CODE = 128 + signal.SIGINT

_ON_SIGINT = (
    "envddp: Ctrl-C (SIGINT): the ranks save a checkpoint at the next step and stop; press Ctrl-C again to stop now,"
    " without it\n"
)

#: Set by a self-launch's agent for its ranks (:mod:`lightning_ddp_amp.launch.selflaunch`): a file it created, where rank 0
#: writes the path of the checkpoint it saved on preemption, so the agent's last line can name it.
PREEMPTION_REPORT_VARIABLE = "LIGHTNING_DDP_AMP_PREEMPTION_REPORT"


class Preemption:
    """Owns SIGTERM, and SIGINT under ``graceful``, while the training loop runs.

    With ``graceful`` (``auto_resume=True``) SIGTERM, or the first SIGINT (Ctrl-C), only raises a flag, and every
    rank learns at an accumulation boundary whether any rank was signalled, and by which: the question goes out as
    a non-blocking all-reduce at one boundary and its answer is read at the next, so the check costs the training
    loop no waiting. A second Ctrl-C is a KeyboardInterrupt again (Lightning's shutdown, without a save). Without
    ``graceful``, SIGTERM ends the process at once (its peers then stop with a "peer is gone" error), SIGINT is
    left to Lightning, and nothing is checked. Outside the training loop both keep whatever handler they had.
    """

    def __init__(self) -> None:
        #: The signal that asked this rank to stop (``signal.SIGTERM`` or ``signal.SIGINT``), 0 while none did.
        self.requested = 0
        self._previous: Any = None
        self._previous_sigint: Any = None
        self._group: Any = None
        self._question: tuple[torch.Tensor, Any] | None = None

    def start(self, graceful: bool, group: Any = None) -> None:
        """Take SIGTERM over, and SIGINT when ``graceful`` (only the main thread can), until :meth:`stop`.

        Args:
            graceful: Raise a flag to agree on (True), or end the process at once (False).
            group: The gloo process group the ranks agree on, apart from the training's collectives.
        """
        self.requested = 0
        self._group = group
        self._question = None
        self._report("")  # an earlier attempt's checkpoint (torchrun restarted the ranks) is not this one's
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm if graceful else signal.SIG_DFL)
        # An ignored SIGINT (a job started in the background, `nohup`) stays ignored: no Ctrl-C is meant to reach it.
        if graceful and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            self._previous_sigint = signal.signal(signal.SIGINT, self._on_sigint)

    def stop(self) -> None:
        """Collect the last question, and give SIGTERM back to the handler it had before :meth:`start`."""
        if self._question is not None:
            self._question[1].wait()
            self._question = None
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
        if self._previous_sigint is not None:
            signal.signal(signal.SIGINT, self._previous_sigint)
        self._previous = self._previous_sigint = None

    def saved(self, checkpoint: Path) -> None:
        """Every rank, once the ranks agreed and saved ``checkpoint``: rank 0 tells a self-launch's agent about it.

        Under any other launcher (no :data:`PREEMPTION_REPORT_VARIABLE`) there is no one to tell, and nothing is done.
        """
        self._report(str(checkpoint))

    def _report(self, text: str) -> None:
        report = os.environ.get(PREEMPTION_REPORT_VARIABLE)
        if report and (not dist.is_initialized() or dist.get_rank() == 0):
            # Only the agent's last line depends on it: a report that cannot be written must not stop training.
            with contextlib.suppress(OSError):
                Path(report).write_text(text)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag: a signal handler must not start collectives, which could interleave with training's.
        self.requested = signal.SIGTERM

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        # The first Ctrl-C saves; the next one is a KeyboardInterrupt again, for whoever cannot wait for the save.
        self.requested = max(self.requested, signal.SIGINT)
        # What SIGINT did before (None: a handler set outside Python, for which Python's own stands in).
        signal.signal(
            signal.SIGINT, signal.default_int_handler if self._previous_sigint is None else self._previous_sigint
        )
        if not dist.is_initialized() or dist.get_rank() == 0:
            # os.write, not print: a handler that prints while the main thread prints would raise in it.
            os.write(sys.stderr.fileno(), _ON_SIGINT.encode())

    def agreed(self) -> int:
        """The signal every rank knows some rank was stopped by (as of the previous boundary), 0 while none was.

        SIGTERM wins over SIGINT when ranks got different ones. Every rank must call this at the same boundaries.
        Without peers the answer is immediate.
        """
        if not dist.is_initialized() or self._group is None:
            return self.requested
        agreed = 0
        if self._question is not None:
            flag, work = self._question
            work.wait()
            agreed = int(flag.item())
        flag = torch.tensor([int(self.requested)])
        self._question = (flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True))
        if agreed:
            self._question[1].wait()  # every rank stops here: leave no question open
            self._question = None
        return agreed


#: The process's one SIGTERM watcher: a signal has one handler, whichever strategy is training.
PREEMPTION = Preemption()
