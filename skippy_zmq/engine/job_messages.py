"""The messages the scheduler sends to stage 0, built from a job: pure, no state kept."""

from __future__ import annotations

import numpy as np

from skippy_zmq.engine.job import Job
from skippy_zmq.protocol.wire import Kind, Message


def _sampling(job: Job) -> dict:
    """Sampling (and constraint, logprobs) for the final stage's sampler of this job."""
    extras = {"sampling": job.req.sampling.to_dict()}
    if job.req.constraint is not None:
        extras["constraint"] = job.req.constraint
    if job.req.logprobs is not None:
        extras["logprobs"] = job.req.logprobs
    return extras


def configure(job: Job, request_id: int) -> Message:
    """CONFIGURE_GENERATION: every stage takes a lane; the last one builds the job's sampler."""
    extras = _sampling(job)
    if job.choice:
        extras["choice"] = job.choice
    return Message(Kind.CONFIGURE_GENERATION, request_id, job.session_id,
                   tokens=np.asarray(job.prompt, np.int32), extras=extras)


def fused_restore(job: Job, request_id: int) -> Message:
    """TRY_RESTORE_PREFILL_DECODE: restore prompt[:-1] and decode the last token in one pass."""
    return Message(Kind.TRY_RESTORE_PREFILL_DECODE, request_id, job.session_id,
                   tokens=np.asarray(job.prompt, np.int32), extras={"namespace": job.namespace, **_sampling(job)})


def prefix_restore(job: Job, request_id: int, matched: int) -> Message:
    """TRY_RESTORE_PREFILL of prompt[:matched]; the suffix is prefilled once it hit."""
    return Message(Kind.TRY_RESTORE_PREFILL, request_id, job.session_id,
                   tokens=np.asarray(job.prompt[:matched], np.int32), extras={"namespace": job.namespace})


def prefill_chunk(job: Job, request_id: int, start: int, end: int, extras: dict) -> Message:
    return Message(Kind.PREFILL, request_id, job.session_id, position=start,
                   tokens=np.asarray(job.history[start:end], np.int32), extras=extras)


def fork(job: Job, request_id: int, children: list[Job]) -> Message:
    """FORK_SESSION: every stage copies choice 0's prompt KV into the children's lanes."""
    return Message(Kind.FORK_SESSION, request_id, job.session_id, position=job.prefill_target,
                   sessions=np.array([job.session_id] + [c.session_id for c in children], np.uint64))


def decode(request_id: int, group: list[Job], rows: list[list[int]], starts: list[int]) -> Message:
    """One DECODE: a row per job (one token, or a verify window) at its absolute start."""
    tokens = [t for row in rows for t in row]
    positions = [p for row, start in zip(rows, starts) for p in range(start, start + len(row))]
    lengths = [len(row) for row in rows]
    extras = {"lengths": lengths} if any(n > 1 for n in lengths) else {}
    return Message(Kind.DECODE, request_id, group[0].session_id, position=starts[0],
                   tokens=np.array(tokens, np.int32), positions=np.array(positions, np.int32),
                   sessions=np.array([j.session_id for j in group], np.uint64), extras=extras)


def stop(job: Job, request_id: int, extras: dict) -> Message:
    return Message(Kind.STOP, request_id, job.session_id, extras=extras)
