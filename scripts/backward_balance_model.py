"""How evenly the backward's key tiles spread over the SMs, for the masked-training cells of a
``bench --backward --masks`` JSON (D = 128: 128-key tiles, 64-row query tiles).

    python scripts/backward_balance_model.py docs/measurements/masked_backward.json [--sms 132]

A key tile's work is counted as the query tiles that see one of its keys (a tile the mask hides entirely
costs nothing). Four launches are compared by their busiest SM over the mean (1.0 = perfectly even): the
persistent grid's static stride (CTA c takes tiles c, c + SMs, ...), one CTA per tile in tile order (the
hardware hands the next tile to the first SM that frees up), the same heaviest tile first, and the dynamic
walk the kernel has (docs/backward.md, "Persistent grid"): slots of paired key tiles j and N-1-j of one
(batch, head), each next slot taken by the first CTA to be free. The static stride is the grid before the
walk, which took the tiles one by one.
"""

from __future__ import annotations

import argparse
import heapq
import json

KEY_TILE, QUERY_TILE, HEAD_DIM = 128, 64, 128


def tile_work(record: dict, heads: int) -> list[int]:
    """Work of every key tile, numbered as the kernel numbers them: key tiles of one (batch, head) next to
    each other."""
    seqlen, batch = record["seqlen"], record["batch"]
    key_tiles, query_tiles = seqlen // KEY_TILE, seqlen // QUERY_TILE
    if record["mask"] == "padding":
        lengths = record["key_lengths"]
        return [query_tiles if j * KEY_TILE < lengths[b] else 0
                for b in range(batch) for _ in range(heads) for j in range(key_tiles)]
    if record["mask"] == "causal":  # key tile j is seen from query tile j * KEY_TILE / QUERY_TILE on
        return [query_tiles - j * KEY_TILE // QUERY_TILE for _ in range(batch * heads) for j in range(key_tiles)]
    raise ValueError(f"no model for the {record['mask']!r} rows")


def static_stride(work: list[int], sms: int) -> float:
    per_cta = [sum(work[c::sms]) for c in range(sms)]
    return max(per_cta) / (sum(work) / sms)


def first_free(work: list[int], sms: int) -> float:
    finish = [0] * sms
    for w in work:
        heapq.heappush(finish, heapq.heappop(finish) + w)
    return max(finish) / (sum(work) / sms)


def paired_slots(work: list[int], key_tiles: int) -> list[int]:
    """The work of each slot of the dynamic walk: key tiles j and N-1-j of one (batch, head) together
    (N odd: the middle one alone)."""
    slots = []
    for head_start in range(0, len(work), key_tiles):
        head = work[head_start:head_start + key_tiles]
        slots += [head[j] + (head[key_tiles - 1 - j] if key_tiles - 1 - j > j else 0)
                  for j in range((key_tiles + 1) // 2)]
    return slots


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json")
    parser.add_argument("--sms", type=int, default=132)
    args = parser.parse_args()
    document = json.load(open(args.json))
    heads = document["settings"]["hidden"] // HEAD_DIM
    print(f"{'mask':<10}{'seqlen':>7}  {'static stride':>14}{'one per tile':>14}{'heaviest first':>16}"
          f"{'paired slots':>14}")
    for record in document["masked_backward"]:
        if record["mask"] not in ("padding", "causal"):
            continue
        work = tile_work(record, heads)
        slots = paired_slots(work, record["seqlen"] // KEY_TILE)
        print(f"{record['mask']:<10}{record['seqlen']:>7}  {static_stride(work, args.sms):>14.3f}"
              f"{first_free(work, args.sms):>14.3f}{first_free(sorted(work, reverse=True), args.sms):>16.3f}"
              f"{first_free(slots, args.sms):>14.3f}")


if __name__ == "__main__":
    main()
