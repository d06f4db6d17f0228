"""Plan and run the census: screen every family in this process (build, one forward and backward, the refusals a
config already tells), then run what is left on gloo ranks, one spawn per mode, and classify each cell.

Classes: ``exact`` (logits and loss <= RTOL_LOGITS, every gradient <= RTOL_GRADS, relative), ``WRONG`` (beyond, or a
parameter whose gradient one process has and the ranks lack), ``refused`` (a one-line reason, by the screen or an
easy_context error raised on the ranks), ``not buildable`` (why), ``CRASH`` (anything else raised on the ranks).
"""
from __future__ import annotations

import os
import queue
import time

RTOL_LOGITS, RTOL_GRADS = 1e-5, 1e-4  # float32 (issue #59): logits / loss, each parameter's gradient
RTOL_FLOAT64 = 1e-9                   # a float32 miss rerun in float64: exact math, any real bug is far above it
SEQ_LEN = 32                          # 4 zigzag chunks of 8 on 2 ranks; longer than the tiny window (tiny.WINDOW)
_REFUSAL_TYPES = ("ValueError", "UsageError", "NotImplementedError", "PackedPositionsError", "AttentionContractError")


def one_line(text: str, limit: int = 300) -> str:
    s = " ".join(str(text).split())
    return s if len(s) <= limit else s[:limit - 3] + "..."


def screen(family: str, modes: list[str], world: int) -> dict:
    """This process: ``{"status": "not buildable", "detail"}`` or ``{"vocab", "impl", "params", "refused": {mode:
    reason}}`` (modes a config-level check refuses before any rank starts)."""
    import torch

    from easy_context.hf.route import check_routable
    from easy_context.parallel_layout import ParallelLayout
    from easy_context.registry import get_mode

    from .tiny import build, tiny_config
    try:
        config, notes = tiny_config(family)
    except Exception as e:  # noqa: BLE001 - the reason is the result
        return {"status": "not buildable", "detail": f"config: {type(e).__name__}: {one_line(e, 200)}"}
    try:
        model, impl = build(family, config)
    except Exception as e:  # noqa: BLE001
        return {"status": "not buildable", "detail": f"model: {type(e).__name__}: {one_line(e, 200)}"}
    params = sum(p.numel() for p in model.parameters())
    try:
        ids = torch.randint(0, 64, (1, SEQ_LEN), generator=torch.Generator().manual_seed(0))
        logits = model(ids, position_ids=torch.arange(SEQ_LEN)[None], use_cache=False).logits
        logits.float().square().mean().backward()
    except Exception as e:  # noqa: BLE001
        return {"status": "not buildable", "detail": f"one-process forward: {type(e).__name__}: {one_line(e, 200)}"}
    emb = model.get_input_embeddings()
    vocab = min(logits.shape[-1], getattr(emb, "num_embeddings", logits.shape[-1]), 128)
    refused = {}
    for mode in modes:
        try:
            check_routable(model, get_mode(mode))
            q, kv = _heads(config)
            if isinstance(q, int):
                ParallelLayout.build(mode, world_size=world).check_heads(q, kv if isinstance(kv, int) else q)
        except ValueError as e:
            refused[mode] = one_line(e)
    return {"status": "built", "vocab": vocab, "impl": impl, "params": params, "notes": notes, "refused": refused}


def _heads(config):
    """(q heads, kv heads) of the text config; (None, None) where they vary by layer (heterogeneous configs)."""
    text = getattr(config, "get_text_config", lambda: config)()
    try:
        return getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None)
    except Exception:  # noqa: BLE001 - transformers' per-layer attribute error: the ranks will tell
        return None, None


def classify_error(tb: str) -> tuple[str, str]:
    """A rank's traceback -> ("refused", reason) for an easy_context error naming what to do, else ("CRASH", it)."""
    lines = [ln for ln in tb.strip().splitlines() if ln.strip()]
    last = lines[-1] if lines else tb
    frames = [ln for ln in lines if ln.lstrip().startswith("File ")]
    inner = frames[-1] if frames else ""
    kind = last.split(":", 1)[0].rsplit(".", 1)[-1]
    if "/easy_context/" in inner and kind in _REFUSAL_TYPES:
        return "refused", one_line(last.split(":", 1)[1] if ":" in last else last)
    where = inner.strip().replace(os.sep.join(("site-packages", "")), "")[-120:]
    return "CRASH", one_line(f"{last} @ {where}")


def _broken(tb: str) -> bool:
    from .rank import BROKEN
    last = [ln for ln in tb.strip().splitlines() if ln.strip()][-1:] or [""]
    return any(b in last[0] for b in BROKEN)


def spawn(cases: list[dict], world: int, timeout: float, collective_timeout: float = 30.0) -> dict:
    """Run ``cases`` on ``world`` gloo ranks; a rank that stops (broken group) is replaced by a fresh spawn for the
    cases left. Returns ``{case index: ("ok", payload) | ("error", traceback)}``."""
    from ...gloo import free_port, rank_context, stop_ranks
    from .rank import rank_entry
    out: dict = {}
    tries: dict = {}
    todo = list(cases)
    deadline = time.monotonic() + timeout
    while todo and time.monotonic() < deadline:
        ctx = rank_context(["torch", "torch.distributed", "transformers", "easy_context.tools.check.census.rank"])
        results, port = ctx.Queue(), free_port()
        procs = [ctx.Process(target=rank_entry, daemon=True, args=(r, world, port, todo, results, collective_timeout,
                                                                   dict(os.environ))) for r in range(world)]
        for p in procs:
            p.start()
        got: dict = {}
        done = set()
        try:
            while len(done) < world and time.monotonic() < deadline:
                try:
                    rank, i, status, payload = results.get(timeout=1.0)
                except queue.Empty:
                    if all(p.exitcode is not None for p in procs):
                        break
                    continue
                if i is None:
                    done.add(rank)
                else:
                    got.setdefault(i, {})[rank] = (status, payload)
        finally:
            stop_ranks(procs)
        left = []
        for c in todo:
            i, per = c["index"], got.get(c["index"], {})
            errors = [p for s, p in per.values() if s == "error"]
            real = [e for e in errors if not _broken(e)]
            if len(per) == world and not errors:
                payload = [p for _, p in per.values() if p is not None]
                out[i] = ("ok", payload[0]) if payload else ("error", "no rank returned a result")
            elif real:
                out[i] = ("error", real[0])
            else:  # the group broke here, or the case was never reached: again, on fresh ranks
                first = not left  # the first undecided case gets the blame when a spawn decides nothing
                tries[i] = tries.get(i, 0) + (1 if errors or first else 0)
                if tries[i] >= 2:
                    out[i] = ("error", errors[0] if errors else "the ranks died before finishing this case")
                else:
                    left.append(c)
        todo = left
    for c in todo:
        out.setdefault(c["index"], ("error", f"not run: census ran past its {timeout:.0f} s timeout"))
    return out


def census(families: list[str], modes: list[str], packed: bool = True, world: int = 2, timeout: float = 7200.0,
           progress=print) -> list[dict]:
    """One row per family x mode x rows (plain, packed): class, errors, detail."""
    rows, cases = [], []
    for family in families:
        try:
            s = screen(family, modes, world)
        except Exception as e:  # noqa: BLE001 - a family the screen itself trips on is reported, not fatal
            s = {"status": "not buildable", "detail": f"screen: {type(e).__name__}: {one_line(e, 200)}"}
        if s["status"] != "built":
            progress(f"  {family}: not buildable ({s['detail'][:100]})")
            rows.append({"family": family, "mode": "-", "rows": "-", "status": "not buildable", "detail": s["detail"]})
            continue
        for mode in modes:
            for kind in (("plain", "packed") if packed else ("plain",)):
                row = {"family": family, "mode": mode, "rows": kind, "params": s["params"], "impl": s["impl"]}
                if mode in s["refused"]:
                    row.update(status="refused", detail=s["refused"][mode])
                else:
                    row["case"] = len(cases)
                    cases.append({"index": len(cases), "family": family, "mode": mode, "packed": kind == "packed",
                                  "seq_len": SEQ_LEN, "vocab": s["vocab"], "seed": 0})
                rows.append(row)
    progress(f"  screened {len(families)} families: {len(cases)} cases to run on {world} ranks")
    for mode in modes:
        mine = [c for c in cases if c["mode"] == mode]
        t0 = time.monotonic()
        outcome = spawn(mine, world, timeout)
        progress(f"  {mode}: {len(mine)} cases in {time.monotonic() - t0:.0f} s")
        for row in rows:
            if row.get("mode") == mode and "case" in row:
                row["_case"] = row.pop("case")
                row.update(judge(outcome[row["_case"]]))
        _rejudge_in_float64([r for r in rows if r.get("mode") == mode], cases, world, timeout, progress)
    for row in rows:
        row.pop("_case", None)
    return rows


def _rejudge_in_float64(rows, cases, world, timeout, progress) -> None:
    """A float32 cell over tolerance runs again in float64: exact there (within ``RTOL_FLOAT64``) means the float32
    difference is rounding (a gradient summed over every token, e.g. DiffLlama's lambdas), not a bug. A missing
    gradient is never rounding."""
    wrong = [r for r in rows if r.get("status") == "WRONG" and "no gradient" not in r.get("detail", "")]
    if not wrong:
        return
    again = [dict(cases[r["_case"]], index=k, dtype="float64") for k, r in enumerate(wrong)]
    outcome = spawn(again, world, timeout)
    for k, row in enumerate(wrong):
        v = judge(outcome[k], RTOL_FLOAT64, RTOL_FLOAT64)
        if v["status"] == "exact":
            row.update(status="exact", detail=f"{row['detail']} in float32; float64 rerun exact "
                                              f"(max {v['max_rel']:.1e}): float32 rounding")
        else:
            row["detail"] += f" (float64 rerun: {v.get('detail', '')}, max {v.get('max_rel', float('nan')):.1e})"
    progress(f"  float64 reruns: {len(wrong)} cells, {sum(r['status'] == 'exact' for r in wrong)} exact there")


def judge(result: tuple, rtol_logits: float = RTOL_LOGITS, rtol_grads: float = RTOL_GRADS) -> dict:
    status, payload = result
    if status == "error":
        cls, detail = classify_error(payload)
        return {"status": cls, "detail": detail}
    r = payload
    worst = max(r["logits"], r["loss"], r["grads"])
    ok = r["logits"] <= rtol_logits and r["loss"] <= rtol_logits and r["grads"] <= rtol_grads
    detail = f"logits {r['logits']:.1e}" + (f", worst gradient {r['worst_grad']}" if r["grads"] > rtol_grads else "")
    if r["missing_grads"]:
        ok = False
        detail += f"; no gradient on the ranks for {', '.join(r['missing_grads'][:2])}"
    return {"status": "exact" if ok else "WRONG", "max_rel": worst, "logits": r["logits"], "loss": r["loss"],
            "grads": r["grads"], "detail": detail}


__all__ = ["census", "screen", "spawn", "judge", "classify_error", "RTOL_LOGITS", "RTOL_GRADS", "SEQ_LEN"]
