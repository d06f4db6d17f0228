"""Model-level equivalence: a sequence-parallel HF model equals the single-process one.

Shared by every mode's tests (zigzag, ulysses, usp, dist_flash). Call from a ``run_ranks`` body:

    from tests.model_equiv import check_model_equivalence
    def _body(rank, world_size):
        for family in ("llama", "mistral", "qwen2"):
            check_model_equivalence(rank, world_size, "zigzag_ring_attn", family)

What is checked (float32, CPU, within ``rel`` = 1e-5 relative, tests/tols.assert_close):
  * the unsharded logits (all_gather over the sp group + ``unshard_sequence``),
  * the global token-mean cross-entropy over valid labels (``-100`` ignored): each rank sums its local
    CE and divides by the all-reduced global valid count, so the all-reduced loss is the true mean even
    when one rank holds no valid label (no NaN),
  * every parameter's gradient, all-reduced (SUM) over the sp group,
against the same model run on the full sequence in this process. Every rank builds the same model from a
config with a fixed seed (no downloads) and the same random tokens.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

from easy_context import (apply_seq_parallel_monkey_patch, prepare_seq_parallel_inputs, shard_sequence,
                          unshard_sequence)
from tests.tols import assert_close

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # fused-op families; more in EXTRA_FAMILIES
EXTRA_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "phi3", "olmo2", "gemma3")
IGNORE = -100

# Tiny but not trivial: GQA (4 q heads / 2 kv heads), head_dim 16, 2 layers, a non-default RoPE theta.
_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=128, max_position_embeddings=4096, rope_theta=50000.0,
               attention_dropout=0.0, tie_word_embeddings=False)


# Families whose attention call carries more than q/k/v (issue #59), tiny and with every feature live at 32 tokens:
# gpt-oss (per-head sinks, sliding window 8 on alternate layers), DeepSeek-V3 (MLA: q/k head dim 24, values 12),
# Llama 4 (chunks of 8 on its RoPE layers, NoPE layers with q temperature from index 7 on), EXAONE 4 (3 sliding : 1
# global, whose module also carries the window).
CONTRACT_FAMILIES = {
    "gpt_oss": ("GptOssConfig", dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                                     num_hidden_layers=2, rope_parameters=None)),
    "deepseek_v3": ("DeepseekV3Config", dict(num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4,
                                             num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                                             kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                                             qk_nope_head_dim=16, v_head_dim=12)),
    "llama4_text": ("Llama4TextConfig", dict(head_dim=16, num_hidden_layers=4, intermediate_size_mlp=128,
                                             num_local_experts=2, attention_chunk_size=8, floor_scale=8,
                                             attn_scale=0.1)),
    "exaone4": ("Exaone4Config", dict(head_dim=16, num_hidden_layers=4, sliding_window=8, sliding_window_pattern=4)),
}
EAGER_FAMILIES = ("gpt_oss",)  # no SDPA in transformers: the reference runs eager


def make_config(family: str, **overrides):
    """A tiny float32 config for ``family`` (mistral/qwen2 with full attention, no sliding window)."""
    import transformers as tf
    kw = dict(_COMMON)
    if family == "llama":
        cls = tf.LlamaConfig
    elif family == "mistral":
        cls, kw["sliding_window"] = tf.MistralConfig, None
    elif family == "qwen2":
        cls, kw["use_sliding_window"], kw["sliding_window"] = tf.Qwen2Config, False, None
    elif family == "qwen3":
        cls, kw["use_sliding_window"], kw["sliding_window"], kw["head_dim"] = tf.Qwen3Config, False, None, 16
    elif family == "mixtral":  # MoE: routing is per token, so SP must leave it untouched
        cls = tf.MixtralConfig
        kw.update(sliding_window=None, num_local_experts=4, num_experts_per_tok=2)
    elif family == "qwen2_moe":  # MoE with a shared expert
        cls = tf.Qwen2MoeConfig
        kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                  use_sliding_window=False, sliding_window=None, decoder_sparse_step=1)
    elif family == "qwen3_moe":
        cls = tf.Qwen3MoeConfig
        kw.update(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
    elif family == "phi3":  # fused qkv_proj / gate_up_proj
        cls = tf.Phi3Config
        kw.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    elif family == "olmo2":  # q/k RMSNorm over all heads
        cls = tf.Olmo2Config
        kw.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    elif family == "gemma3":  # local/global layers (window >= the length: exact), query_pre_attn_scalar, sandwich norms
        cls = tf.Gemma3TextConfig
        kw.update(head_dim=16, sliding_window=4096, query_pre_attn_scalar=16, rope_local_base_freq=10000.0,
                  pad_token_id=0, bos_token_id=2, eos_token_id=1)
    elif family in CONTRACT_FAMILIES:  # issue #59: sinks, MLA, chunked attention, sliding:global layers
        cls, extra = CONTRACT_FAMILIES[family]
        kw = dict(_COMMON, **extra)
        cls = getattr(tf, cls)
    else:
        from tests.hybrid_models import MAMBA2, SUPPORTED, make_hybrid_config  # softmax + recurrent hybrids (issue #30)
        if family in SUPPORTED + MAMBA2:
            return make_hybrid_config(family, **overrides)
        raise ValueError(f"unknown family {family!r}; choose one of {FAMILIES + EXTRA_FAMILIES + SUPPORTED}")
    kw.update(overrides)
    return cls(**kw)


def build_model(family: str, seed: int = 0, attn_implementation: str = "sdpa", **overrides):
    """The same tiny float32 causal LM on every rank (fixed seed; built from a config)."""
    import transformers as tf
    from tests.hybrid_models import MAMBA2, SUPPORTED, build_hybrid
    if family in SUPPORTED + MAMBA2:  # softmax + recurrent hybrids (issue #30)
        return build_hybrid(family, seed, attn_implementation, **overrides)
    torch.manual_seed(seed)
    if family in EAGER_FAMILIES:
        attn_implementation = "eager"
    model = tf.AutoModelForCausalLM.from_config(make_config(family, **overrides), dtype=torch.float32,
                                                attn_implementation=attn_implementation)
    return model.float().train()


def make_batch(batch: int, seq_len: int, vocab: int, seed: int = 1, labels_mask=None):
    """Random tokens; ``target = next token``, invalid targets set to -100.

    labels_mask: None (all valid) | "random" (about half masked) | a bool (batch, seq_len) tensor of
    valid positions.
    """
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq_len + 1), generator=g)
    input_ids, target_ids = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    valid = torch.ones(batch, seq_len, dtype=torch.bool)
    if isinstance(labels_mask, str):
        if labels_mask != "random":
            raise ValueError(f"labels_mask preset {labels_mask!r}; use 'random', 'one_rank' or a bool tensor")
        valid = torch.rand(batch, seq_len, generator=g) < 0.5
        valid[:, 0] = True  # never all masked
    elif labels_mask is not None:
        valid = labels_mask.bool().clone()
    target_ids[~valid] = IGNORE
    position_ids = torch.arange(seq_len).unsqueeze(0).expand(batch, -1).clone()
    return input_ids, position_ids, target_ids


def _loss_sum_and_count(logits, target_ids):
    """Sum of CE over valid targets (0, not NaN, when none is valid) and the number of valid targets."""
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target_ids.reshape(-1),
                         ignore_index=IGNORE, reduction="sum")
    return ce, (target_ids != IGNORE).sum()


def reference_step(model, input_ids, position_ids, target_ids):
    """Single-process full-sequence forward/backward: (logits, loss, {name: grad})."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids, position_ids=position_ids, use_cache=False).logits
    ce, n = _loss_sum_and_count(logits, target_ids)
    loss = ce / n
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return logits.detach(), loss.detach(), grads


def per_document_reference(model, input_ids, position_ids, target_ids):
    """Reference for packed rows: every document (positions restarting at 0) run through the model on its
    own, logits concatenated back; loss = token mean over all documents; grads of that loss."""
    model.zero_grad(set_to_none=True)
    logits = []
    for b in range(input_ids.shape[0]):
        starts = (position_ids[b] == 0).nonzero().flatten().tolist()
        if not starts or starts[0] != 0:
            starts = [0] + starts
        cuts = starts + [input_ids.shape[1]]
        row = [model(input_ids[b:b + 1, s:e], position_ids=position_ids[b:b + 1, s:e], use_cache=False).logits
               for s, e in zip(cuts[:-1], cuts[1:])]
        logits.append(torch.cat(row, dim=1))
    logits = torch.cat(logits, dim=0)
    ce, n = _loss_sum_and_count(logits, target_ids)
    loss = ce / n
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return logits.detach(), loss.detach(), grads


def _sp_group(groups):
    """The process group spanning the sequence-parallel ranks (the world unless ``group`` is given)."""
    if groups and groups.get("group") is not None:
        return groups["group"]
    return None


def check_model_equivalence(rank, world_size, seq_algo, family, seq_len=32, batch=2, layout_kw=None,
                            groups=None, labels_mask=None, *, patch="instance", sp_group=None,
                            rel=1e-5, seed=0, model_kw=None, prepare_sp_model=None, position_ids=None,
                            dispatch="auto"):
    """Assert that ``seq_algo`` on this sp group reproduces single-process logits, loss and grads.

    rank/world_size: this process in the world (used only for messages; sp rank/size come from the sp
    group). layout_kw: extra kwargs of the layout (``ring_degree=`` for usp). groups: process-group
    kwargs for ``apply_seq_parallel_monkey_patch`` (``{"group": g}`` or usp's ring/ulysses groups).
    sp_group: the group over which the sequence is split and grads are summed (default: ``groups["group"]``,
    else the world). labels_mask: None | "random" | "one_rank" (every valid label on sp rank 0) | a bool
    (batch, seq_len) tensor of valid positions. position_ids: packed rows (restarting at 0 per document);
    the reference then runs every document separately (``per_document_reference``). prepare_sp_model: called with the patched sequence-parallel model (not the
    reference) before it runs. patch: "instance" (patch the model object) or "family"
    (patch the family string, build the model after, restore with "data_parallel" at the end).
    dispatch: how packed rows are cut: "auto" (a cost-balanced table, carried to the attention in the model call's
    kwargs, what train.py does) or None (the fixed k-pair cut of the plain ``model(ids, position_ids=pos)`` call).
    """
    layout_kw = dict(layout_kw or {})
    groups = dict(groups or {})
    packed_positions = position_ids
    sp_group = sp_group if sp_group is not None else _sp_group(groups)
    sp_rank, sp_size = dist.get_rank(sp_group), dist.get_world_size(sp_group)
    mask_name = labels_mask if labels_mask is None or isinstance(labels_mask, str) else "tensor"
    tag = f"[{seq_algo} {family} W={sp_size} rank {rank}/{world_size} mask={mask_name} patch={patch}]"

    ref = build_model(family, seed=seed, **(model_kw or {}))
    if isinstance(labels_mask, str) and labels_mask == "one_rank":
        # every valid label on sp rank 0 (its shard of the positions in this layout); the other ranks
        # have local CE sums of 0 and must still give finite losses and correct grads
        held = shard_sequence(seq_algo, torch.arange(seq_len), 0, sp_size, dim=-1, **layout_kw)
        labels_mask = torch.zeros(batch, seq_len, dtype=torch.bool)
        labels_mask[:, held] = True
    input_ids, position_ids, target_ids = make_batch(batch, seq_len, ref.config.vocab_size, seed=seed + 1,
                                                     labels_mask=labels_mask)
    assert (target_ids != IGNORE).any(), f"{tag}: test setup has no valid label"
    sp_model = copy.deepcopy(ref)  # identical weights, before anything touches ref
    if packed_positions is not None:
        position_ids = packed_positions.expand(batch, -1).clone() if packed_positions.dim() == 1 or \
            packed_positions.shape[0] == 1 else packed_positions.clone()
        tag = tag[:-1] + f" packed docs={int((position_ids == 0).sum())}]"
        ref_logits, ref_loss, ref_grads = per_document_reference(ref, input_ids, position_ids, target_ids)
    else:
        ref_logits, ref_loss, ref_grads = reference_step(ref, input_ids, position_ids, target_ids)

    try:
        if patch == "family":
            apply_seq_parallel_monkey_patch(seq_algo, family, **groups)
            fresh = build_model(family, seed=seed + 123, **(model_kw or {}))  # built AFTER the patch
            fresh.load_state_dict(sp_model.state_dict())
            sp_model = fresh
        elif patch == "instance":
            out = apply_seq_parallel_monkey_patch(seq_algo, sp_model, **groups)
            assert out is sp_model
        else:
            raise ValueError(f"patch must be 'instance' or 'family', got {patch!r}")
        if prepare_sp_model is not None:  # e.g. checkpointing options on the SP model only; a returned model
            sp_model = prepare_sp_model(sp_model) or sp_model  # replaces it (copy.deepcopy of the patched model)

        prepared = prepare_seq_parallel_inputs(seq_algo, input_ids, position_ids, target_ids, sp_rank, sp_size,
                                               torch.device("cpu"), dispatch=dispatch, **layout_kw)
        # the local positions are the true global ones (RoPE stays right)
        assert torch.equal(prepared["local_position_ids"], shard_sequence(
            seq_algo, position_ids, sp_rank, sp_size, dim=-1, positions=position_ids,
            dispatch=prepared.layout.dispatch, **layout_kw))
        sp_model.zero_grad(set_to_none=True)
        logits = sp_model(prepared["local_input_ids"], position_ids=prepared["local_position_ids"],
                          use_cache=False, **prepared.model_kwargs).logits
        local_sum, local_n = _loss_sum_and_count(logits, prepared["local_target_ids"])
        n = local_n.clone()
        dist.all_reduce(n, group=sp_group)
        loss = local_sum / n
        assert torch.isfinite(loss), f"{tag}: local loss is {loss.item()} (local valid labels {int(local_n)})"
        loss.backward()

        total = loss.detach().clone()
        dist.all_reduce(total, group=sp_group)
        gathered = [torch.empty_like(logits) for _ in range(sp_size)]
        dist.all_gather(gathered, logits.detach().contiguous(), group=sp_group)
        full_logits = unshard_sequence(seq_algo, gathered, dim=1, layout=prepared.layout)
        assert_close(full_logits, ref_logits, rel, f"{tag} logits")
        assert_close(total, ref_loss, rel, f"{tag} loss")
        for name, p in sp_model.named_parameters():
            assert p.grad is not None, f"{tag}: no gradient for {name}"
            g = p.grad.detach().clone()
            dist.all_reduce(g, group=sp_group)
            assert_close(g, ref_grads[name], rel, f"{tag} grad {name}")
    finally:
        if patch == "family":
            apply_seq_parallel_monkey_patch("data_parallel", family)
    if patch == "family" and packed_positions is None:
        # restored: a model built now runs plain full-sequence attention again
        plain = build_model(family, seed=seed, **(model_kw or {}))
        with torch.no_grad():
            again = plain(input_ids, position_ids=position_ids, use_cache=False).logits
        assert_close(again, ref_logits, rel, f"{tag} logits after restoring data_parallel")
