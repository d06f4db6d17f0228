"""What every spawned rank of ``python -m easy_context check`` runs (gloo, CPU, float32).

Per case: build the model from the prepared config with a fixed seed (identical weights on every rank),
patch a copy with ``apply_seq_parallel_monkey_patch``, cut the batch with ``prepare_seq_parallel_inputs``,
run forward + backward, and bring the full logits (all-gather + ``unshard_sequence``), the token-mean loss and
every gradient (SUM over the sp group) to sp rank 0, which compares them with the same model run on the full
sequence in one process (per document for packed rows). Numbers go back to the parent; the parent judges.
"""
from __future__ import annotations

import copy
import traceback

from ...loss import IGNORE_INDEX as IGNORE
from ...loss import global_count, global_sum, token_nll_sum


def rank_entry(rank: int, world_size: int, port: int, cases: list, results, collective_timeout: float, env) -> None:
    """Process target: one gloo process; puts ``(rank, case_index, "info"|"ok"|"error", payload)`` per case,
    then ``(rank, None, "done", None)``. ``env``: the caller's environment (a forked rank has the server's)."""
    from ..gloo import gloo_process
    try:
        with gloo_process(rank, world_size, port, collective_timeout, {"TRANSFORMERS_VERBOSITY": "error", **env}):
            for i, case in enumerate(cases):
                try:
                    send = (lambda payload, i=i: results.put((rank, i, "info", payload)))
                    results.put((rank, i, "ok", run_case(case, send)))
                except Exception:  # reported per case; the parent turns it into FAIL with the message
                    results.put((rank, i, "error", traceback.format_exc()))
            results.put((rank, None, "done", None))
    except BaseException:
        results.put((rank, None, "error", traceback.format_exc()))


# ---------------------------------------------------------------------------------------------- inputs
def packed_positions(batch: int, seq_len: int, seed: int):
    """Rows of packed documents: positions restart at 0 at random starts (about one per 6 tokens, so
    documents cross shard and zigzag-chunk edges and some are a single token)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    rows = []
    n_cuts = max(1, seq_len // 6)
    for _ in range(batch):
        starts = sorted((torch.randperm(seq_len - 1, generator=g)[:n_cuts] + 1).tolist())
        pos = torch.arange(seq_len)
        for s, e in zip(starts, starts[1:] + [seq_len]):
            pos[s:e] = torch.arange(e - s)
        rows.append(pos)
    return torch.stack(rows)


def make_batch(batch: int, seq_len: int, vocab: int, seed: int, packed: bool):
    """Random tokens, ``target = next token``; with packing, a document's last token has no target."""
    import torch
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq_len + 1), generator=g)
    input_ids, target_ids = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    if packed:
        position_ids = packed_positions(batch, seq_len, seed + 7)
        last = torch.zeros_like(position_ids, dtype=torch.bool)
        last[:, :-1] = position_ids[:, 1:] == 0
        last[:, -1] = True
        target_ids[last] = IGNORE
    else:
        position_ids = torch.arange(seq_len).unsqueeze(0).expand(batch, -1).clone()
        target_ids[:, -1] = IGNORE  # the batch's last token has no next token either
    return input_ids, position_ids, target_ids


def _grads(model) -> dict:
    import torch
    # a parameter that got no gradient (an MoE expert no token picked) counts as zeros, on both sides
    return {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
            for n, p in model.named_parameters()}


def add_lora(model, case):
    """LoRA (rank ``case.lora``) on every linear layer, as train.py does after the sp patch; A and B drawn from
    ``case.seed`` so the adapter changes the output (PEFT starts B at zero) and both sides hold the same one."""
    import torch
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(model, LoraConfig(r=case.lora, lora_alpha=2 * case.lora, lora_dropout=0.0,
                                             target_modules="all-linear", task_type="CAUSAL_LM"))
    g = torch.Generator().manual_seed(case.seed + 5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def reference_step(model, input_ids, position_ids, target_ids, packed: bool, moe_aux: float = 0.0):
    """One process, full rows (each packed document on its own): logits, token-mean loss, grads.
    ``moe_aux``: plus that times the model's own router load-balancing loss (Hugging Face's ``aux_loss``)."""
    import torch
    model.zero_grad(set_to_none=True)
    if moe_aux:
        out = model(input_ids, position_ids=position_ids, use_cache=False, output_router_logits=True)
        ce, n = token_nll_sum(out.logits, target_ids)
        loss = ce / n + moe_aux * out.aux_loss
        loss.backward()
        return out.logits.detach(), loss.detach(), _grads(model)
    if packed:
        rows = []
        for b in range(input_ids.shape[0]):
            starts = (position_ids[b] == 0).nonzero().flatten().tolist()
            cuts = starts + [input_ids.shape[1]]
            rows.append(torch.cat([model(input_ids[b:b + 1, s:e], position_ids=position_ids[b:b + 1, s:e],
                                         use_cache=False).logits for s, e in zip(cuts[:-1], cuts[1:])], dim=1))
        logits = torch.cat(rows, dim=0)
    else:
        logits = model(input_ids, position_ids=position_ids, use_cache=False).logits
    ce, n = token_nll_sum(logits, target_ids)
    loss = ce / n
    loss.backward()
    return logits.detach(), loss.detach(), _grads(model)


# ---------------------------------------------------------------------------------------------- reporting
def rope_info(model) -> list[dict]:
    """RoPE as the instantiated model's rotary module(s) will apply it: type and theta from the module's own
    config (what it built ``inv_freq`` from), plus theta recomputed from ``inv_freq`` for the default type."""
    out = []
    for name, mod in model.named_modules():
        if not type(mod).__name__.endswith("RotaryEmbedding"):
            continue
        rp = getattr(getattr(mod, "config", None), "rope_parameters", None) or {}
        types = getattr(mod, "rope_type", None)
        nested = isinstance(types, dict)
        for key in (sorted(types) if nested else [None]):
            params = rp.get(key, {}) if nested else rp
            rope_type = types[key] if nested else types
            theta = params.get("rope_theta")
            inv = getattr(mod, f"{key}_inv_freq" if nested else "inv_freq", None)
            derived = None
            if rope_type == "default" and inv is not None and inv.numel() > 1:
                # inv_freq[i] = theta^(-2i/d), d = 2 * len(inv_freq)
                derived = float(inv.double()[1] ** (-inv.numel()))
            extra = {k: v for k, v in params.items() if k not in ("rope_type", "rope_theta")}
            out.append({"module": name + (f"[{key}]" if nested else ""), "rope_type": rope_type,
                        "theta": theta, "theta_from_inv_freq": derived, "scaling": extra})
    return out


def diff(actual, expected) -> dict:
    """Max abs difference and the relative error ||a - e|| / ||e|| (tests/tols.py's measure)."""
    a, e = actual.detach().double(), expected.detach().double()
    if a.shape != e.shape:
        return {"max_abs": float("inf"), "rel": float("inf"), "shape": f"{tuple(a.shape)} != {tuple(e.shape)}"}
    d = (a - e).abs()
    finite = bool(a.isfinite().all())
    return {"max_abs": float(d.max()) if finite else float("inf"),
            "rel": float(d.norm() / e.norm().clamp_min(1e-30)) if finite else float("inf"),
            "ref_max": float(e.abs().max())}


# ---------------------------------------------------------------------------------------------- one case
def run_case(case, send=lambda payload: None) -> dict | None:
    """Run one check on this rank; sp rank 0 of every dp group returns the comparison, others None.
    Global rank 0 ``send``s what it built first, so a report has the model and RoPE even if the run raises."""
    import torch
    import torch.distributed as dist
    import transformers as tf

    from easy_context import apply_seq_parallel_monkey_patch, unshard_sequence
    from easy_context.parallel_layout import ParallelLayout

    # new_group is collective: every rank builds both layouts in the same order
    layout = ParallelLayout.build(case.mode, sp_size=case.sp, ring_degree=case.ring)
    run_layout = layout if case.ring_run == case.ring else \
        ParallelLayout.build(case.mode, sp_size=case.sp, ring_degree=case.ring_run)
    sp_group, root = layout.sp_group, layout.sp_rank == 0

    def build(config):
        torch.manual_seed(case.seed)
        cls = tf.AutoModelForCausalLM._model_mapping[type(config)]  # eager where the family has no SDPA (gpt-oss)
        m = tf.AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32, attn_implementation=(
            "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"))
        from easy_context.recurrent.init import slow_decay_
        slow_decay_(m, case.seed)  # hybrids: a decay that keeps the state alive (recurrent/init.py says why)
        return m.float().train()

    base = build(case.config)
    ref = copy.deepcopy(base) if root else None  # before anything patches it
    if case.sp_config is not None:  # self-test: same weights, different RoPE in the sp model only
        sp_model = build(case.sp_config)
        sp_model.load_state_dict(base.state_dict())
    else:
        sp_model = base
    if dist.get_rank() == 0:
        send({"model_class": type(base).__name__, "n_params": sum(p.numel() for p in base.parameters()),
              "rope_ref": rope_info(ref), "rope_sp": rope_info(sp_model)})
    apply_seq_parallel_monkey_patch(case.mode, sp_model, layout=run_layout)
    if case.head_chunks > 1:  # train.py --checkpointing offload --head-chunks N
        from easy_context.memory import configure_memory
        configure_memory(sp_model, "offload", head_chunks=case.head_chunks)
    if case.lora:  # after the patch, as train.py does
        sp_model = add_lora(sp_model, case)
        ref = add_lora(ref, case) if root else None

    vocab = base.config.vocab_size
    input_ids, position_ids, target_ids = make_batch(case.batch, case.seq_len, vocab,
                                                     case.seed + 1 + layout.dp_rank, case.packed)
    prepared = layout.prepare_inputs(input_ids, position_ids, target_ids, torch.device("cpu"))  # as train.py cuts
    sp_model.zero_grad(set_to_none=True)
    out = sp_model(prepared["local_input_ids"], position_ids=prepared["local_position_ids"], use_cache=False,
                   **prepared.model_kwargs, **({"output_router_logits": True} if case.moe_aux else {}))
    logits = out.logits
    local_sum, local_n = token_nll_sum(logits, prepared["local_target_ids"])
    loss = local_sum / global_count(local_n, sp_group)  # the global token mean, whatever this rank holds
    if case.moe_aux:  # this rank's share of the global load-balancing loss (train.py's, one all-reduce)
        from easy_context.moe import router_aux_loss
        loss = loss + case.moe_aux * router_aux_loss(out.router_logits, sp_model.config)[0]
    loss.backward()
    total = global_sum(loss, sp_group)
    gathered = [torch.empty_like(logits) for _ in range(layout.sp)]
    dist.all_gather(gathered, logits.detach().contiguous(), group=sp_group)
    grads = _grads(sp_model)
    for g in grads.values():  # same order on every rank (named_parameters)
        dist.all_reduce(g, group=sp_group)
    if not root:
        return None

    full_logits = unshard_sequence(case.mode, gathered, dim=1, layout=prepared.layout)  # the cut's exact inverse
    ref_logits, ref_loss, ref_grads = reference_step(ref, input_ids, position_ids, target_ids, case.packed,
                                                     case.moe_aux)
    grad_diffs = {name: diff(grads[name], ref_grads[name]) for name in ref_grads}
    docs = [int((position_ids[b] == 0).sum()) for b in range(position_ids.shape[0])]
    return {"dp_rank": layout.dp_rank, "docs": docs,
            "logits": diff(full_logits, ref_logits),
            "loss": {**diff(total, ref_loss), "ref": float(ref_loss), "sp": float(total)},
            "grads": grad_diffs}
