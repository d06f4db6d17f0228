"""Sequence-parallel inference shared by eval_needle.py and eval_ppl.py.

Three things a long-context eval needs, none of which materialises full-sequence logits:

* ``SeqParallelLM.nll(input_ids, target_ids)`` — one sequence-parallel forward of the decoder (the model's
  attention routed through the chosen mode, inputs sharded like training), then the LM head and the
  cross-entropy applied in chunks of tokens on the *scored* positions only: memory is
  ``chunk x vocab`` instead of ``tokens x vocab`` (EasyContext upcast all local logits to fp32).
  Returns ``(sum of NLL, number of scored tokens)`` summed over the sp group, so a caller computes a
  token-weighted perplexity ``exp(total NLL / total tokens)``; a rank without scored tokens adds 0/0.
* ``SeqParallelLM.generate(prompt_ids, max_new_tokens)`` — greedy decoding of a prompt that only fits
  sharded over the ranks. Equal to single-process ``model.generate(do_sample=False)`` token for token.
* ``SeqParallelLM.teacher_forced(prompt_ids, answer_ids)`` — EasyContext's needle scoring (argmax given
  the gold prefix), computing logits only at the answer positions.

How decoding works (exact; the prompt KV never moves)
-----------------------------------------------------
1. Prefill: the padded prompt is sharded with the mode's layout (``shard_sequence``) and run once through
   the model. Our attention function (registered with transformers' ``AttentionInterface``) calls the
   mode's sequence-parallel attention and also keeps, per layer, this rank's post-RoPE K/V of its own
   shard (padding positions dropped). Zigzag/USP shards are not contiguous — that does not matter,
   because every prompt token precedes every generated token (no causal mask is needed at decode).
2. The last prompt token's hidden state lives on one rank (zigzag: rank 0, which holds the last chunk);
   every rank contributes its rows (zeros elsewhere) to an all-reduce, so all ranks hold it, apply the LM
   head to that one row and agree on the greedy token (rank 0's choice is broadcast to be safe).
3. Decode step: the new token runs through the model on every rank (replicated, q length 1). In each layer
   its query attends to
     a) every rank's local prompt KV: each rank computes a partial ``(out, lse)`` with
        ``kernels.attn_forward(q, K_local, V_local, causal=False)``, the partials are all-gathered
        (``B x Hq x (D+1)`` floats per layer per rank) and merged with ``kernels.merge_attn_out``
        (the log-sum-exp merge of ring attention / flash-decoding's split-KV combine), and
     b) the generated tokens' own K/V, kept replicated on all ranks (tiny).
   The merge runs in the same order on every rank, so all ranks compute identical hidden states.
Per step the traffic is one all-gather of ``W x B x Hq x (D+1)`` floats per layer, independent of the
prompt length; prompt KV memory stays ``S/W`` per rank, as in training.

With ``seq_algo="data_parallel"`` (or an sp group of one rank) the same code runs without collectives: the
scripts then split documents/prompts over ranks instead.

Layout legend: HF passes attention ``query (B, Hq, L, D)``, ``key/value (B, Hkv, L, D)``; kernels take
``(B, L, H, D)``; ``lse`` fp32 ``(B, Hq, L)``.
"""
from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import kernels
from .api import seq_multiple, shard_sequence
from .loss import IGNORE_INDEX, chunked_nll_sum, global_sum
from .registry import DEFAULT_MODE, PLAIN_MODE, get_mode


# ----------------------------------------------------------------------------------------------
# process groups and model loading
# ----------------------------------------------------------------------------------------------
def init_distributed(timeout_s: float = 1800.0):
    """Init the default process group when launched by torchrun/accelerate (WORLD_SIZE > 1).

    Returns ``(rank, world_size, device)``. NCCL on CUDA, gloo on CPU.
    """
    import datetime

    world = int(os.environ.get("WORLD_SIZE", "1"))
    use_cuda = torch.cuda.is_available() and os.environ.get("ACCELERATE_USE_CPU", "").lower() not in ("1", "true")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():  # the store on loopback unless MASTER_ADDR is another address
        from .rendezvous import init_process_group
        init_process_group("nccl" if use_cuda else "gloo", int(os.environ["RANK"]), world,
                           datetime.timedelta(seconds=timeout_s))
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), device
    return 0, 1, device


def sp_group_kwargs(seq_algo: str, ring_degree: int | None = None) -> dict:
    """Process-group keyword arguments for ``seq_algo`` spanning the whole world (usp_attn: ring x ulysses =
    world, ``ring_degree`` = ring). Built by ``ParallelLayout`` (every rank must call it: new_group is
    collective); kept for callers that bind groups themselves."""
    from .parallel_layout import ParallelLayout
    return ParallelLayout.build(seq_algo, ring_degree=ring_degree).attn_groups()


def load_model(path: str, rope_theta: float | None = None, dtype: torch.dtype | None = None,
               device: torch.device | str = "cpu"):
    """AutoModelForCausalLM + AutoTokenizer from a local directory (or a Hub id when online).

    ``rope_theta`` overrides the config (transformers 5 keeps it in ``config.rope_parameters``).
    Default dtype: bf16 on CUDA, fp32 on CPU. Raises ``FileNotFoundError`` with the fix for a bad path.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not os.path.isdir(os.path.expanduser(path)) and (path.startswith((".", "/", "~")) or path.count("/") != 1):
        raise FileNotFoundError(
            f"model path {path!r} does not exist; pass a directory written by save_pretrained "
            "(config.json, weights, tokenizer files) or an 'org/name' Hub id with network access")
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as e:  # offline Hub id, missing config.json, ...
        raise FileNotFoundError(f"cannot load a model config from {path!r}: {e}") from e
    if rope_theta is not None:
        from .hf.config import set_rope_theta  # the one place that knows where configs keep theta
        set_rope_theta(config, rope_theta)
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


# ----------------------------------------------------------------------------------------------
# chunked LM head + NLL
# ----------------------------------------------------------------------------------------------
def logits_of(model, hidden: torch.Tensor) -> torch.Tensor:
    """fp32 logits of a few rows of final hidden states (the LM head as HF applies it)."""
    logits = model.get_output_embeddings()(hidden).float()
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def chunked_nll(model, hidden: torch.Tensor, targets: torch.Tensor, chunk_tokens: int | None = None):
    """Sum of token NLL and count of scored tokens; logits exist for ``chunk_tokens`` rows at a time.

    hidden ``(..., H)``, targets ``(...)`` with ``-100`` = not scored. Only scored rows go through the head.
    Returns ``(nll_sum float64 scalar, count int64 scalar)`` (``easy_context.loss.chunked_nll_sum``).
    """
    vocab = model.get_output_embeddings().weight.shape[0]
    return chunked_nll_sum(lambda rows: logits_of(model, rows), hidden, targets, vocab, chunk_tokens)


# ----------------------------------------------------------------------------------------------
# the engine
# ----------------------------------------------------------------------------------------------
class _State:
    def __init__(self):
        self.phase = "forward"      # forward | prefill | decode
        self.keep = None            # (S_local,) bool: real (unpadded) positions of this rank's shard
        self.prompt_pos = None      # (S_keep,) global positions of the kept prompt rows (sliding windows)
        self.cur = 0                # global position of the token being decoded
        self.prompt_kv = {}         # layer -> (K, V) local prompt shard, (B, S_keep, Hkv, D)
        self.gen_kv = {}            # layer -> (K, V) generated tokens, replicated


class SeqParallelLM:
    """A causal LM run sequence-parallel for evaluation (see the module docstring).

    ``layout``: a ``ParallelLayout`` whose sp group is the world (default: built from ``seq_algo`` and
    ``ring_degree``): the one carrier of mode, degrees and groups; ``SeqParallelLM(model, layout)`` passes it in
    ``seq_algo``'s place. ``groups``: explicit process-group kwargs instead (``sp_group_kwargs``; the sp group is
    then the world or the mode's ``group``).
    """

    def __init__(self, model, seq_algo: str | None = None, groups: dict | None = None,
                 ring_degree: int | None = None, chunk_tokens: int | None = None, layout=None):
        from transformers.masking_utils import AttentionMaskInterface
        from transformers.modeling_utils import AttentionInterface

        from .hf import _check_mask, make_attention_fn
        from .parallel_layout import ParallelLayout

        if isinstance(seq_algo, ParallelLayout):  # SeqParallelLM(model, layout)
            if layout is not None and layout is not seq_algo:
                raise ValueError("SeqParallelLM: pass one ParallelLayout, not two")
            seq_algo, layout = None, seq_algo
        if layout is not None and (groups is not None or ring_degree is not None
                                   or seq_algo not in (None, layout.seq_algo, layout.mode)):
            raise ValueError(f"SeqParallelLM: pass either layout= (here {layout.seq_algo} {layout}) or "
                             f"seq_algo/groups/ring_degree, not both (got seq_algo={seq_algo!r}, "
                             f"ring_degree={ring_degree})")
        mode = layout.mode if layout is not None else get_mode(seq_algo or DEFAULT_MODE)
        if mode.is_parallel:  # a layer the AttentionInterface does not reach: refused, never silently wrong
            from .hf.route import check_routable
            check_routable(model, mode)
        self.model, self.mode, self.chunk_tokens = model, mode, chunk_tokens
        if groups is None:
            layout = layout or ParallelLayout.build(mode, ring_degree=ring_degree)
            if layout.dp > 1 and mode.is_parallel:
                raise ValueError(f"SeqParallelLM runs one sequence over the world; {layout} has dp > 1")
            groups = layout.attn_groups()
        self.layout = layout
        self.groups = dict(groups)
        self.group = self.groups.get("group")       # the sp group for our own collectives (None = world)
        if not mode.is_parallel or not dist.is_initialized():
            self.world, self.rank = 1, 0
        elif "group" in self.groups:
            self.world, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        else:  # usp: ring x ulysses spans the world
            self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.layout_kw = layout.layout_kw if layout is not None else mode.layout_kw(ring_degree=ring_degree)
        self.device = next(model.parameters()).device
        self.state = _State()
        from .recurrent.inference import attach  # hybrids (issue #30): chain prefill, replicated decode state
        self._recurrent = attach(model, mode if self.world > 1 else PLAIN_MODE, self.groups, self.state,
                                 self.group)
        self._sp_attn = make_attention_fn(mode, **self.groups) if self.world > 1 else None
        state, engine = self.state, self

        def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      sliding_window=None, **kwargs):
            if state.phase == "decode":
                return engine._decode_attention(module, query, key, value, scaling, sliding_window), None
            if engine._sp_attn is not None:
                out, _ = engine._sp_attn(module, query, key, value, attention_mask, dropout=dropout,
                                         scaling=scaling, sliding_window=sliding_window, **kwargs)
            else:
                docs = None
                if sliding_window is not None and sliding_window < query.shape[2]:  # a local layer
                    from .packing import Documents
                    n = query.shape[2]
                    idx = torch.arange(n)
                    docs = Documents(torch.zeros(1, n, dtype=torch.long), sliding_window).block(idx, idx)
                out, _ = kernels.attn_forward(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                              causal=True, softmax_scale=scaling, docs=docs)
            if state.phase == "prefill":
                keep = state.keep
                state.prompt_kv[module.layer_idx] = (key.transpose(1, 2)[:, keep].contiguous(),
                                                     value.transpose(1, 2)[:, keep].contiguous())
            return out, None

        def mask_fn(*args, **kwargs):
            _check_mask(kwargs.get("attention_mask"))
            return None  # our kernels apply the global causal mask themselves

        name = f"easy_context_infer_{id(model):x}"
        AttentionInterface.register(name, attention)
        AttentionMaskInterface.register(name, mask_fn)
        self._prev_attn = model.config._attn_implementation
        model.set_attn_implementation(name)

    @property
    def seq_algo(self) -> str:
        """The mode's name (the string form)."""
        return self.mode.name

    def close(self):
        """Give the model its previous attention implementation back."""
        self.model.set_attn_implementation(self._prev_attn)
        if self._recurrent is not None:
            from .recurrent.inference import detach
            detach(self.model)

    # -- helpers ----------------------------------------------------------------------------------
    def _shard(self, full: torch.Tensor, pad_value: int):
        """Pad ``(B, S)`` at the end to the mode's multiple and take this rank's shard."""
        mult = seq_multiple(self.mode, self.world, **self.layout_kw) if self.world > 1 else 1
        pad = (-full.shape[1]) % mult
        if pad:
            full = F.pad(full, (0, pad), value=pad_value)
        if self.world == 1:
            return full
        return shard_sequence(self.mode, full, self.rank, self.world, dim=1, **self.layout_kw)

    def _local_positions(self, n: int, batch: int) -> torch.Tensor:
        """Global positions of this rank's shard of the padded ``(B, n)`` sequence: ``(B, S_local)``."""
        mult = seq_multiple(self.mode, self.world, **self.layout_kw) if self.world > 1 else 1
        m = n + (-n) % mult  # padding sits at the end, so it never changes a real token's result
        return self._shard(torch.arange(m, device=self.device).unsqueeze(0).expand(batch, m), pad_value=0)

    def _forward(self, input_ids: torch.Tensor, pad_id: int):
        """SP forward of the decoder: (local hidden (B, S_local, H), local global positions (S_local,))."""
        b, n = input_ids.shape
        local_ids = self._shard(input_ids.to(self.device), pad_value=pad_id)
        local_pos = self._local_positions(n, b)
        out = self.model.get_decoder()(input_ids=local_ids, position_ids=local_pos, use_cache=False)
        return out.last_hidden_state, local_pos[0]

    def _rows(self, hidden: torch.Tensor, local_pos: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Hidden states of global positions [start, end), replicated on every rank (all-reduce of owners)."""
        b, _, h = hidden.shape
        buf = torch.zeros(b, end - start, h, dtype=hidden.dtype, device=hidden.device)
        sel = ((local_pos >= start) & (local_pos < end)).nonzero().squeeze(-1)
        if sel.numel():
            buf[:, local_pos[sel] - start] = hidden[:, sel]
        if self.world > 1:
            dist.all_reduce(buf, group=self.group)  # x + 0 = x: exact
        return buf

    # -- perplexity ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def nll(self, input_ids: torch.Tensor, target_ids: torch.Tensor, pad_id: int = 0):
        """(sum of NLL, scored-token count) of ``target_ids`` (-100 = unscored) over the sp group."""
        self.state.phase = "forward"
        hidden, _ = self._forward(input_ids, pad_id)
        local_t = self._shard(target_ids.to(self.device), pad_value=IGNORE_INDEX)
        s, c = chunked_nll(self.model, hidden, local_t, self.chunk_tokens)
        del hidden
        if self.world > 1:
            pair = global_sum(torch.stack([s, c.double()]), self.group)
            s, c = pair[0], pair[1].round().long()
        return s.item(), int(c.item())

    # -- needle ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def teacher_forced(self, prompt_ids: torch.Tensor, answer_ids: torch.Tensor, pad_id: int = 0):
        """Greedy tokens predicted at the answer positions given the gold answer prefix: (B, A)."""
        self.state.phase = "forward"
        p, a = prompt_ids.shape[1], answer_ids.shape[1]
        hidden, local_pos = self._forward(torch.cat([prompt_ids, answer_ids], dim=1), pad_id)
        rows = self._rows(hidden, local_pos, p - 1, p + a - 1)
        return logits_of(self.model, rows).argmax(-1)

    @torch.inference_mode()
    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int, eos_token_id=None, pad_id: int = 0):
        """Greedy decoding (batch 1): the new tokens, a list of ints, ending at EOS if one is produced."""
        if prompt_ids.shape[0] != 1:
            raise ValueError(f"generate takes one prompt (batch 1); got batch {prompt_ids.shape[0]}")
        eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
        st = self.state
        n = prompt_ids.shape[1]
        st.prompt_kv, st.gen_kv = {}, {}
        try:
            st.phase = "prefill"
            if self._recurrent is not None:
                self._recurrent.prompt_len = n
            pos = self._local_positions(n, 1)[0]
            st.keep = pos < n
            st.prompt_pos = pos[st.keep]
            hidden, local_pos = self._forward(prompt_ids, pad_id)
            last = self._rows(hidden, local_pos, n - 1, n)[:, -1]
            del hidden
            st.phase = "decode"
            new = []
            for step in range(max_new_tokens):
                tok = logits_of(self.model, last).argmax(-1)
                if self.world > 1:  # identical on all ranks by construction; rank 0 decides
                    dist.broadcast(tok, src=dist.get_global_rank(self.group, 0) if self.group is not None
                                   else 0, group=self.group)
                new.append(int(tok.item()))
                if new[-1] in eos or step == max_new_tokens - 1:
                    break
                st.cur = n + step
                out = self.model.get_decoder()(input_ids=tok.view(1, 1),
                                               position_ids=torch.tensor([[n + step]], device=self.device),
                                               use_cache=False)
                last = out.last_hidden_state[:, -1]
            return new
        finally:
            st.phase, st.keep, st.prompt_kv, st.gen_kv, st.prompt_pos = "forward", None, {}, {}, None

    def _decode_attention(self, module, query, key, value, scaling, window=None):
        """One new token's attention over [distributed prompt KV] + [replicated generated KV]; a layer's
        sliding window keeps only keys at positions > cur - window (HF's rule)."""
        st = self.state
        q = query.transpose(1, 2)                                   # (B, 1, Hq, D)
        k_new, v_new = key.transpose(1, 2), value.transpose(1, 2)   # (B, 1, Hkv, D)
        layer = module.layer_idx
        if layer in st.gen_kv:
            gk, gv = st.gen_kv[layer]
            k_new, v_new = torch.cat([gk, k_new], dim=1), torch.cat([gv, v_new], dim=1)
        st.gen_kv[layer] = (k_new, v_new)
        scale = scaling if scaling is not None else 1.0 / math.sqrt(q.shape[-1])
        b, _, hq, d = q.shape
        # generated block first: it always contains the token itself, so the running lse is finite and
        # an empty prompt shard (lse = -inf) merges as a no-op.
        pk, pv = st.prompt_kv[layer]
        if window is not None:
            k_new, v_new = k_new[:, -window:], v_new[:, -window:]  # generated rows end at cur
            near = st.prompt_pos > st.cur - window
            pk, pv = pk[:, near], pv[:, near]
        o, l = kernels.attn_forward(q, k_new, v_new, causal=False, softmax_scale=scale)
        acc_out = o.float()
        acc_lse = l.float().clone()
        if pk.shape[1]:
            po, pl = kernels.attn_forward(q, pk, pv, causal=False, softmax_scale=scale)
        else:
            po = q.new_zeros(b, 1, hq, d)
            pl = torch.full((b, hq, 1), float("-inf"), device=q.device)
        if self.world > 1:
            flat = torch.cat([po.float().reshape(b, -1), pl.float().reshape(b, -1)], dim=1)
            parts = [torch.empty_like(flat) for _ in range(self.world)]
            dist.all_gather(parts, flat, group=self.group)
            for part in parts:  # same order on every rank -> bitwise identical results
                kernels.merge_attn_out(acc_out, acc_lse, part[:, :hq * d].view(b, 1, hq, d),
                                       part[:, hq * d:].view(b, hq, 1))
        else:
            kernels.merge_attn_out(acc_out, acc_lse, po, pl)
        return acc_out.to(query.dtype)


__all__ = ["SeqParallelLM", "chunked_nll", "logits_of", "load_model", "init_distributed", "sp_group_kwargs",
           "IGNORE_INDEX"]
