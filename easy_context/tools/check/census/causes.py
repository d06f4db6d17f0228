"""Why a family's cells are WRONG or CRASH, where that is known (issue #59's root causes; transformers 5.24 line
numbers). Rendered under the census table; a family fixed or refused drops out of it by itself (only the families
with a WRONG / CRASH cell are listed)."""
from __future__ import annotations

_SINKS = ("attention sinks: the layer passes s_aux=self.sinks (one learned logit per head joining every softmax "
          "denominator); hf/attention.py drops it (no sinks gradient, logits off)")
_WINDOW_FALLBACK = ("full-attention layers pass sliding_window=None explicitly but keep module.sliding_window = "
                    "config.sliding_window on every layer; hf/attention.py's fallback `if sliding_window is None: "
                    "sliding_window = module.sliding_window` (meant for Qwen2-MoE, which passes nothing) windows the "
                    "global layers")
_POSITIONS = ("packed rows only: the attention layer never receives position_ids (it takes them by name and keeps them, "
              "or the decoder does not pass them on), so hf/attention.py sees no document starts and attends across "
              "documents")
_KWARGS = ("packed rows only: the decoder layer calls self_attn with position_ids but without **kwargs, so the "
           "dispatch table of prepare_inputs (sp_dispatch) never reaches the attention: DispatchError telling the user "
           "to pass what they passed")
CAUSES = {
    "gpt_oss": _SINKS + " (modeling_gpt_oss.py:322)",
    "granite_swa": _SINKS + " (modeling_granite_swa.py:191; eager applies it as out * sigmoid(lse - sink))",
    "granitemoe_swa": _SINKS + " (modeling_granitemoe_swa.py:271)",
    "flint": _SINKS + " (modeling_flint.py:302; no SDPA: reference eager)",
    "mimo_v2_flash": "sinks on the sliding layers only (s_aux=None on full ones, modeling_mimo_v2_flash.py:400) and "
                     "value head dim != query/key head dim (MLA-like, refused by the kernels' k/v shape check today)",
    "exaone4": _WINDOW_FALLBACK + " (modeling_exaone4.py:199, :252)",
    "exaone_moe": _WINDOW_FALLBACK + " (modeling_exaone_moe.py:150, :203)",
    "kolibri1": _WINDOW_FALLBACK + " (modeling_kolibri1.py:150, :202)",
    "llama4_text": "chunked local attention (attention_chunk_size) lives only in the mask, which the patch replaces by None",
    "llama4": "as llama4_text (its text model)",
    "persimmon": _POSITIONS + " (PersimmonAttention.forward takes position_ids, modeling_persimmon.py:237)",
    "fuyu": _POSITIONS + " (its language model is Persimmon)",
    "moshi": _POSITIONS + " (MoshiAttention.forward takes position_ids)",
    "gpt_bigcode": _POSITIONS + " (GPTBigCodeModel uses position_ids for wpe only, modeling_gpt_bigcode.py:470)",
    "ctrl": _POSITIONS + " (CTRLModel uses position_ids for its sinusoidal table only, modeling_ctrl.py:320)",
    "dory": _POSITIONS + " (DoryModel calls its layers with **kwargs only, modeling_dory.py:494)",
    "stablelm": _KWARGS + " (StableLmDecoderLayer, modeling_stablelm.py:349)",
    "nemotron": _KWARGS + " (NemotronDecoderLayer, modeling_nemotron.py:318)",
    "diffllama": "packed ulysses only, the lambda_q1 gradient just beyond tolerance: a sum over every token "
                 "(likely float32 rounding, not verified against float64)",
}

__all__ = ["CAUSES"]
