"""The flight recorder's part of `paratrain run`'s failure report: where each rank was in its
collectives, which ranks are behind, and where their histories first part.

Each rank of this node leaves its ring (`<pid>.ring`, debug/flight_recorder.py). Operations are
compared per process group by their number on that group (#k: the k-th this rank issued on it),
so ranks that also used other groups still line up. For each rank the report names the oldest
operation that never completed (where it is blocked, or where it gave up), else its last one;
then, per group, the ranks that issued the fewest operations on it (behind), and the first #k
where the ranks disagree: another operation or tensor shape, or a rank that never issued it.
Point-to-point operations are shown where a rank is blocked in one but not compared (a send and
its receive differ by nature). `alone` names, where the ranks part, a collective call of the
user's (a Session method every rank must call, recorded as each operation's `within`) that some
ranks were in and the others not: "rank 0 called session.checkpoint alone (at train.py:51)".
"""

from __future__ import annotations

import os

from paratrain.debug import flight_recorder

# operations whose first tensor must have the same shape and dtype on every rank
SAME_SHAPE = {"all_reduce", "broadcast", "reduce", "all_gather", "all_gather_single", "all_gather_into_tensor",
              "reduce_scatter_single", "reduce_scatter_tensor", "all_reduce_coalesced"}


def read_rings(notes_dir: str, pids: dict[int, int | None]) -> dict[int, dict]:
    """rank -> its ring, for the ranks (rank -> pid) that left one."""
    rings = {}
    for rank, pid in pids.items():
        ring = flight_recorder.read(os.path.join(notes_dir, f"{pid}.ring")) if pid else None
        if ring is not None:
            rings[rank] = ring
    return rings


def describe(rings: dict[int, dict]) -> list[str]:
    """The report's lines (none without rings)."""
    if not rings:
        return []
    world = _world(rings)
    capacity = max(r["capacity"] for r in rings.values())
    lines = [f"collectives (each rank's last {capacity}, from its flight recorder; #k = the k-th on that group):"]
    lines += ["  " + _where(rank, ring, world) for rank, ring in sorted(rings.items())]
    groups = _groups(rings)
    for group in groups:
        members = [r for r in group if r in rings]
        if len(members) > 1:
            lines += ["  " + line for line in _behind(group, members, rings, world)]
    if split := _first_split(rings):
        _, group, k, seen = split
        lines.append(f"  the histories diverge at #{k} on {_group(group, world)}: " + _sides(seen, k, world))
    elif any(len([r for r in g if r in rings]) > 1 for g in groups):
        # p2p operations are not compared: a pipeline's stages pair a send with a receive, batched or not
        p2p = any(g and g[0] == "p2p" for r in rings.values() for g, _ in r["issued"])
        lines.append("  the ranks of this node issued the same collectives, in the same order"
                     + (" (point-to-point operations are not compared)" if p2p else ""))
    return lines


def alone(rings: dict[int, dict]) -> str | None:
    """'rank 0 called session.checkpoint alone (at bad.py:51): …' when, where the ranks'
    histories first part, some ranks were inside a collective call of the user's (a Session
    method every rank must call: flight_recorder.within) that the others were not in; else None."""
    split = _first_split(rings) if rings else None
    if split is None:
        return None
    _, _, k, seen = split
    inside = sorted((e["started"], r, e["within"]) for r, e in seen.items() if e and e.get("within"))
    if not inside:
        return None
    name = inside[0][2]
    ranks = sorted(r for _, r, within in inside if within == name)
    others = {r: e for r, e in seen.items() if r not in ranks}
    if not others:
        return None  # every rank was in it: they called it alike, and parted inside it
    world = _world(rings)
    instead = "; ".join(f"rank {r} never issued #{k}" if e is None else
                        f"rank {r} called {e['op']}{_tensor(e)} at {_site(e)}"
                        + (f" in {e['within']}" if e.get("within") else "") + " instead"
                        for r, e in sorted(others.items()))
    return (f"{_ranks(ranks)} called {name} alone (at {_place(seen[ranks[0]])}): at #{k} on "
            f"{_group(tuple(seen[ranks[0]]['group']), world)}, {instead}. {name} is a collective: call it "
            "on every rank, at the same point of the loop")


def waited_in(ring: dict | None) -> str | None:
    """'all_reduce at train.py:69': the oldest operation of the ring that never completed."""
    pending = [e for e in (ring or {}).get("entries", []) if e["state"] in ("started", "failed")]
    return f"{pending[0]['op']} at {_place(pending[0])}" if pending else None


def _world(rings: dict[int, dict]) -> int:
    return max((r.get("world") or 0 for r in rings.values()), default=0)


def _groups(rings: dict[int, dict]) -> list[tuple]:
    return sorted({tuple(g) for r in rings.values() for g, _ in r["issued"] if g and g[0] != "p2p"},
                  key=lambda g: (-len(g), g))


def _first_split(rings: dict[int, dict]) -> tuple[float, tuple, int, dict] | None:
    """(when, group, #k, rank -> its entry or None) of the earliest divergence over every group."""
    splits = []
    for group in _groups(rings):
        members = [r for r in group if r in rings]
        if len(members) > 1 and (split := _divergence(group, members, rings)):
            splits.append(split)
    return min(splits, key=lambda s: s[0]) if splits else None


def _where(rank: int, ring: dict, world: int) -> str:
    entries = ring["entries"]
    if not entries:
        return f"rank {rank} issued no collective"
    pending = [e for e in entries if e["state"] in ("started", "failed")]
    if not pending:
        return f"rank {rank} is in no collective; its last was {_op(entries[-1], world)}, {entries[-1]['state']}"
    e = pending[0]
    more = f" ({len(pending) - 1} more started after it)" if len(pending) > 1 else ""
    if e["state"] == "failed":
        return f"rank {rank} gave up in {_op(e, world)}{more}: {e['error']}"
    waited = ring["time"] - e["started"]
    return f"rank {rank} is blocked in {_op(e, world)}{more}, for {waited:.1f} s when its ring was written"


def _behind(group: tuple, members: list[int], rings: dict, world: int) -> list[str]:
    issued = {r: _issued(rings[r], group) for r in members}
    fewest = min(issued.values())
    if fewest == max(issued.values()):
        return []
    behind = [r for r in members if issued[r] == fewest]
    ahead = ", ".join(f"rank {r} up to #{issued[r] - 1}" for r in members if issued[r] != fewest)
    last = f"up to #{fewest - 1}" if fewest else "none"
    return [f"behind on {_group(group, world)}: {_ranks(behind)} (issued {last}; {ahead})"]


def _divergence(group: tuple, members: list[int], rings: dict) -> tuple[float, tuple, int, dict] | None:
    """(when, group, #k, rank -> entry) for the first #k on `group` where the members disagree
    (None when they agree)."""
    by_k = {r: {e["gseq"]: e for e in rings[r]["entries"] if tuple(e["group"]) == group} for r in members}
    issued = {r: _issued(rings[r], group) for r in members}
    first = max(min(by_k[r], default=issued[r]) for r in members)  # older ones left some ring
    for k in range(first, max(issued.values())):
        seen = {r: by_k[r].get(k) for r in members}
        if any(seen[r] is None and k < issued[r] for r in members):
            continue  # not in that rank's ring any more: cannot tell
        if len({_signature(e) for e in seen.values()}) > 1:
            return min(e["started"] for e in seen.values() if e), group, k, seen
    return None


def _sides(seen: dict[int, dict | None], k: int, world: int) -> str:
    """'rank 0 called all_reduce(float32[4]) at a.py:9 (in <module>); rank 1 never issued #3'."""
    sides: dict[str, list[int]] = {}
    for rank, e in seen.items():
        what = (f"called {e['op']}{_tensor(e)} at {_site(e)}" if e else f"never issued #{k}")
        sides.setdefault(what, []).append(rank)
    return "; ".join(f"{_ranks(ranks)} {what}" for what, ranks in sides.items())


def _signature(e: dict | None):
    if e is None:
        return None
    return e["op"], e["tensors"][0] if e["op"] in SAME_SHAPE and e["tensors"] else None


def _issued(ring: dict, group: tuple) -> int:
    return next((n for g, n in ring["issued"] if tuple(g) == group), 0)


def _op(e: dict, world: int) -> str:
    """'#3 all_reduce(float32[4]) on the world group at train.py:9 (in <module>)'; with a label,
    '… send to 1, recv from 1 for ring attention (cp): K, V at model.py:40 (in forward)'."""
    where = e["detail"] if e["detail"] else f"on {_group(tuple(e['group']), world)}"
    # optional: a ring written by another paratrain version may lack it
    label = f" for {e['label']}" if e.get("label") else ""
    return f"#{e['gseq']} {e['op']}{_tensor(e)} {where}{label} at {_site(e)}"


def _tensor(e: dict) -> str:
    return f"({e['tensors'][0]})" if e["tensors"] else ""


def _group(group: tuple, world: int) -> str:
    if group and group[0] == "p2p":
        return f"p2p between ranks {', '.join(map(str, group[1:]))}"
    if world and group == tuple(range(world)):
        return f"the world group (ranks {_span(group)})"
    return f"the group of ranks {_span(group)}"


def _span(ranks: tuple) -> str:
    if len(ranks) > 2 and ranks == tuple(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


def _site(e: dict) -> str:
    """'train.py:12 (in step)', relative to the launcher's folder when under it."""
    if not e.get("file"):
        return "an unknown place (no Python caller)"
    return f"{_place(e)} (in {e['function']})"


def _place(e: dict) -> str:
    """'train.py:12'."""
    if not e.get("file"):
        return "an unknown place"
    path = os.path.relpath(e["file"])
    return f"{e['file'] if path.startswith('..') else path}:{e['line']}"


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
