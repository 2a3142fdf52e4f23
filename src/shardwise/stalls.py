"""No silent hangs: turn a collective that timed out (or lost a peer) into an error that says
which collective, and which rank never joined it.

Gloo reports only "Timed out waiting 300000ms for recv operation to complete". Two things make
that useful:

- PyTorch's flight recorder (enabled for every process group before it is made) remembers the
  collectives this rank issued: the newest is the one it is waiting in, by name, group, sequence
  number and tensor shapes.
- Every rank whose collective fails posts that collective to the rendezvous store and, for a few
  seconds, reads what the others posted. A rank that posts nothing never reached the point of
  waiting: it is the stalled (or crashed, or busy) one. Ranks that posted different collectives
  disagree on what comes next, a bug that `launch.debug_collectives` pins down at the first
  mismatched call (TORCH_DISTRIBUTED_DEBUG=DETAIL checks every collective across ranks first).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable

import torch.distributed as dist
from torch._C._distributed_c10d import _dump_fr_trace_json

from shardwise.dist import DistContext, job_store, restart_count

# How long a rank whose collective failed waits for the others to report theirs.
REPORT_GRACE_S = 3.0


class CollectiveFailure(RuntimeError):
    """A collective timed out or lost a peer; the message names it and the ranks that never
    joined it."""


def is_collective_failure(error: BaseException) -> bool:
    """Gloo's words for a collective that timed out, or whose peer closed the connection: one that
    died, or gave up on the same collective first (the ranks of a stalled collective do not all
    time out at the same instant)."""
    return isinstance(error, RuntimeError) and any(
        words in str(error) for words in ("Timed out waiting", "Connection closed by peer"))


def newest_collective() -> dict[str, object] | None:
    """The newest collective this rank issued, as the flight recorder saw it."""
    entries = json.loads(_dump_fr_trace_json(True, False)).get("entries", [])
    if not entries:
        return None
    entry = max(entries, key=lambda e: e["time_created_ns"])
    return {
        "op": entry["profiling_name"].split(":", 1)[-1],
        "group": entry["process_group"][1] or entry["process_group"][0],
        "seq": entry["collective_seq_id"] or entry["p2p_seq_id"],
        "sizes": entry["input_sizes"],
        "dtypes": entry["input_dtypes"],
    }


def describe(collective: dict[str, object] | None) -> str:
    if collective is None:
        return "a collective the flight recorder did not see"
    tensors = ", ".join(f"{dtype}{size}" for size, dtype in zip(collective["sizes"], collective["dtypes"],
                                                                strict=False))
    return f"{collective['op']} #{collective['seq']} on group '{collective['group']}' ({tensors or 'no tensors'})"


def explain(error: BaseException, ctx: DistContext, timeout_s: float, where: str) -> CollectiveFailure:
    """The CollectiveFailure to raise instead of Gloo's `error`, after learning from the other
    ranks (through the rendezvous store) which of them also waited and in what."""
    mine = newest_collective()
    what = f"did not complete within launch.timeout_s = {timeout_s:g} s" if "Timed out" in str(error) else \
        "failed: a peer closed its connection"
    head = f"rank {ctx.rank}: {describe(mine)} {what} ({where})"
    try:
        reports = _exchange_reports_in_time(ctx, mine)
    except (RuntimeError, OSError, TimeoutError) as store_error:  # DistStoreError is a RuntimeError
        agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        suspect = "" if agent_hosts_store or ctx.rank == 0 else "; rank 0 hosts it and is probably the stalled one"
        return CollectiveFailure(
            f"{head}. Which rank is missing is unknown: the rendezvous store did not answer "
            f"({store_error}){suspect}. Original error: {error}")
    missing = [rank for rank in range(ctx.world_size) if rank not in reports]
    if missing:
        waited = ", ".join(map(str, sorted(reports)))
        return CollectiveFailure(
            f"{head}. Rank(s) {', '.join(map(str, missing))} never joined it: within {REPORT_GRACE_S:g} s they "
            f"did not report waiting in any collective (stalled, crashed, or busy outside "
            f"collectives), while rank(s) {waited} did. Original error: {error}")
    distinct = {json.dumps(c, sort_keys=True) for c in reports.values()}
    if len(distinct) > 1:
        each = "; ".join(f"rank {rank}: {describe(c)}" for rank, c in sorted(reports.items()))
        return CollectiveFailure(
            f"{head}. Every rank was waiting, in different collectives ({each}): the ranks disagree on which "
            "collective comes next. Rerun with --debug-collectives to stop at the first mismatched call.")
    return CollectiveFailure(
        f"{head}. Every rank was waiting in the same collective: the network or a peer's transport "
        f"stopped delivering. Original error: {error}")


def _exchange_reports_in_time(ctx: DistContext, mine: dict[str, object] | None) -> dict[int, dict[str, object] | None]:
    """_exchange_reports, given up on after twice the grace period: a stopped store host leaves
    a new client blocked in its handshake, whatever its timeout says. The thread is a daemon, so
    a blocked one does not keep the failing process alive."""
    outcome: dict[str, object] = {}

    def exchange() -> None:
        try:
            outcome["reports"] = _exchange_reports(ctx, mine)
        except (RuntimeError, OSError) as error:
            outcome["error"] = error

    thread = threading.Thread(target=exchange, name="shardwise-timeout-reports", daemon=True)
    thread.start()
    thread.join(2 * REPORT_GRACE_S + 2)
    if "error" in outcome:
        raise outcome["error"]
    if "reports" not in outcome:
        raise TimeoutError(f"no answer within {2 * REPORT_GRACE_S + 2:g} s")
    return outcome["reports"]


def _exchange_reports(ctx: DistContext, mine: dict[str, object] | None) -> dict[int, dict[str, object] | None]:
    """Post this rank's collective; return every rank's that arrives within the grace period."""
    store = dist.PrefixStore(
        f"shardwise/timeouts/{restart_count()}",
        job_store(REPORT_GRACE_S + 5),
    )
    store.set(f"rank{ctx.rank}", json.dumps(mine))
    keys = [f"rank{rank}" for rank in range(ctx.world_size)]
    _within_grace(lambda: store.check(keys))
    present = [key for key in keys if store.check([key])]
    reports = {int(key.removeprefix("rank")): json.loads(store.get(key)) for key in present}
    # The store may live in one of these processes (rank 0's, when torchrun does not host it):
    # none leaves, taking it down, before every rank that reported has read the reports.
    store.add("read", 1)
    with contextlib.suppress(RuntimeError):  # the host left once all had read: nothing is lost
        _within_grace(lambda: store.add("read", 0) >= len(present))
    return reports


def _within_grace(condition: Callable[[], bool]) -> None:
    """Poll `condition` until it holds or REPORT_GRACE_S has passed."""
    deadline = time.monotonic() + REPORT_GRACE_S
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
