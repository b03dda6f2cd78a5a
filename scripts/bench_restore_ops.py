"""The metadata operations of one whole restore, every rank counted at its own coordinate.

    python scripts/bench_restore_ops.py MODEL FROM TO DIR [--every N]    e.g. 7B 64 48 /dev/shm/ops

`--per-node L`: the step is saved in the per-node layout, L ranks a node (rank by rank: slow), and
a node file counts once however many of its ranks' ranges a rank reads.
`--fold L` (per-rank steps): also the count were the same files one per node of L ranks (the
per-node layout's opens, worked out from the same plans: no per-node save needed, which runs rank
by rank).
`--exchange 1` (per-rank steps): also the count with the reshard exchange (checkpoint/exchange.py:
each saved shard opened by its owner alone, the bytes sent to the ranks that need them), and the
time of each sampled rank's exchange plan.
`--every N`: only rank 0 and every N-th rank plan (a systematic sample: 16,384 -> 12,288 ranks in
minutes); the total is rank 0's count plus the sample's mean times the other W - 1 ranks.

scripts/bench_scale.py counts rank 0's pick + rank 0's plan + (W - 1) x one other rank's plan
(at its own coordinate), the read's opens left out. The step is saved by bench_scale's
production save (`save_collective`, replica detection included, on an FSDP2 + Adam state). Here each of the TO ranks plans its own box (`restoreplan.plan_part` as
rank r, counted at the same os seam), and the source shards its read opens are added (the read
keeps the plan's fds: it opens only the sources the plan did not). The FROM-rank step is saved
under DIR/MODEL-FROM by bench_scale's harness (stamped, every rank's files kept) unless there.
Each rank costs one plan: keep TO to a few hundred.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_scale as bs  # noqa: E402

from slurmresume.checkpoint import exchange  # noqa: E402
from slurmresume.checkpoint.boxes import plan_reads  # noqa: E402
from slurmresume.checkpoint.collective import Group  # noqa: E402
from slurmresume.checkpoint.shardread import split_locator  # noqa: E402
from slurmresume.checkpoint.state import flatten_live  # noqa: E402
from slurmresume.train import messages, restorechoice, restoreload, restoreplan  # noqa: E402


def main(argv: list[str]) -> int:
    flags = {"--every": 1, "--per-node": 0, "--fold": 0, "--exchange": 0}
    while len(argv) > 4 and argv[-2] in flags and argv[-1].isdigit():
        flags[argv[-2]], argv = int(argv[-1]), argv[:-2]
    every, per_node, fold, swap = max(flags["--every"], 1), flags["--per-node"], flags["--fold"], flags["--exchange"]
    if len(argv) != 4 or not argv[1].isdigit() or not argv[2].isdigit() or argv[0] not in bs.MODELS:
        print("usage: bench_restore_ops.py MODEL FROM TO DIR [--every N] [--per-node L] [--fold L] [--exchange 1] "
              f"(MODEL among {', '.join(bs.MODELS)})", file=sys.stderr)
        return 2
    layout = f"-node{per_node}" if per_node else ""
    model, frm, to, root = argv[0], int(argv[1]), int(argv[2]), Path(argv[3]) / f"{argv[0]}-{argv[1]}{layout}"
    if not (root / bs.step_dir_name(bs.STEP) / "COMMITTED").exists():
        root.mkdir(parents=True, exist_ok=True)
        bs.save_rank0(model, frm, root, bs.Ops(), per_node=per_node)
    ops, per, folded, swapped, took, fanout, choice, wire, sent = bs.Ops(), [], [], [], [], [], None, None, b""
    planning: list[float] = []
    ranks = range(0, to, every)
    for rank in ranks:
        state = bs.rank_state(model, bs.fake_world(to, rank), to, rank)
        live = flatten_live(state)
        with bs.Fabric(to).installed(), ops.counting() as counts:
            if choice is None:  # rank 0 picks; the others get the choice as it crosses the wire and
                choice = restorechoice.pick(root, None, False, set(), False, None)  # the manifest's bytes
                wire = messages.pick_from_json(json.loads(json.dumps(messages.pick_to_json(choice))))
                sent = choice.manifest.raw_bytes or b""  # (restoreload.share_manifest sends them unchanged)
            began = time.perf_counter()
            with restoreplan.gc_paused():  # what restoreload.load_choice runs on every rank: plan, exchange plan
                planned = choice if rank == 0 else restoreplan.with_manifest(wire, sent)
                part = restoreplan.plan_part(rank, planned, state, live, True)
                restoreload.exchange_plan(Group(None, rank, to), planned, part)
            planning.append(time.perf_counter() - began)
            n = bs.Ops.total(counts)
        if isinstance(part, messages.Failure):
            print(f"rank {rank}: {part.message}", file=sys.stderr)
            return 1
        opened = {split_locator(f)[0] for f in part.opened._files}  # the files the plan has open, kept for the read
        sources = plan_reads(part.wanted, part.where)[1]  # the saved ranks the read takes boxes from
        per.append(n + len({split_locator(part.manifest.shards[r]["file"])[0] for r in sources} - opened))
        if swap:  # the same plan, each saved shard opened by its owner alone (exchange.owner)
            with restoreplan.gc_paused():  # as restoreload.load_choice runs it
                began = time.perf_counter()
                xplan = exchange.plan(rank, to, frm, part.wanted, part.where, part.boxes)
                took.append(time.perf_counter() - began)
            if xplan is None:
                print(f"rank {rank}: no exchange plan for these specs", file=sys.stderr)
                return 1
            swapped.append(n + len(set(xplan.owned) - {int(f[5:10]) for f in opened}))
            fanout.append(len(part.sources | {part.src}))  # what "auto" sums (exchange.worth_it)
        if fold:  # the same plan, its shard files folded into the node files of L ranks each
            mine = {int(f[5:10]) for f in opened} | sources
            folded.append(n - len(opened) + len({r // fold for r in mine}))
        part.opened.close()
    if swap:
        report(f"{model} {frm} -> {to}, with the exchange", swapped, to, every)
        mean = sum(fanout) / len(fanout)
        print(f"  reading their own boxes the ranks would open ~{mean:.2f} shard files each: SLURMRESUME_RESHARD_EXCHANGE="
              f"auto {'takes' if exchange.wanted(None, to) == 'auto' and exchange.worth_it(round(mean * to), to) else 'does not take'} the exchange "
              f"(over {exchange.FANOUT} a rank, from {exchange.EXCHANGE_MIN_RANKS} ranks on)")
        worst = max(range(len(took)), key=took.__getitem__)
        print(f"  exchange plan per rank: median {statistics.median(took) * 1e3:.1f} ms, max {took[worst] * 1e3:.1f} ms "
              f"(rank {list(ranks)[worst]}; {len(took)} ranks)")
    if fold:
        report(f"{model} {frm} -> {to}, folded into node files of {fold} ranks", folded, to, every)
    report(f"{model} {frm} -> {to}", per, to, every)
    rest = planning[1:] or planning
    print(f"  plan per rank (the manifest's parse, plan_part and, where production makes it, the exchange plan; "
          f"{len(rest)} ranks but 0): median {statistics.median(rest) * 1e3:.1f} ms, max {max(rest) * 1e3:.1f} ms")
    return 0


def report(what: str, per: list[int], to: int, every: int) -> None:
    if every > 1:  # a systematic sample: rank 0, then every N-th rank, standing for the ranks between
        rest = per[1:] or [0]
        total = per[0] + round(sum(rest) / len(rest) * (to - 1))
        print(f"{what}: ~{total:,} metadata operations = {total / to:.3f} x W, sampled: rank 0 "
              f"{per[0]}, {len(rest)} of the other ranks (every {every}-th) {min(rest)}-{max(rest)}, mean "
              f"{sum(rest) / len(rest):.3f}")
        return
    total = sum(per)
    print(f"{what}: {total:,} metadata operations = {total / to:.3f} x W (rank 0 {per[0]}, "
          f"per rank {min(per)}-{max(per)})")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
