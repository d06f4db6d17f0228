"""What eval_needle.py and eval_ruler.py share: flags, model/engine set-up, greedy SP generation, chat-template
wrapping of token-id prompts, prompt splitting over data-parallel ranks, and atomic output files.
"""
from __future__ import annotations

import csv
import io
import os
import tempfile

import torch
import torch.distributed as dist

SEED = 24242424  # EasyContext's seed


def add_common_args(p, default_max_new_tokens_help: str):
    """Flags both evals take with the same meaning (eval_needle's names, kept for its users)."""
    from easy_context.registry import DEFAULT_MODE, mode_names
    p.add_argument("--model", default="PY007/Llama2-7B-64K", help="local model directory (save_pretrained) or Hub id")
    p.add_argument("--max_context_length", type=int, default=100000, help="largest length (tokens)")
    p.add_argument("--min_context_length", type=int, default=1000, help="smallest length (tokens)")
    p.add_argument("--context_interval", type=int, default=1000, help="step between lengths (tokens)")
    p.add_argument("--num_samples", type=int, default=10, help="prompts per grid cell")
    p.add_argument("--rope_theta", "--rope-theta", dest="rope_theta", type=float, default=None,
                   help="override the config's RoPE theta")
    p.add_argument("--haystack_dir", default=None, help="folder of *.txt (sorted); default: generated filler")
    p.add_argument("--parallel_mode", default=DEFAULT_MODE, choices=mode_names(),
                   help="sequence parallelism over the launched ranks; data_parallel splits prompts instead")
    p.add_argument("--ring_degree", type=int, default=None, help="usp_attn only: ring size (ring x ulysses = world)")
    p.add_argument("--max_new_tokens", type=int, default=None, help=default_max_new_tokens_help)
    p.add_argument("--chat-template", "--chat_template", dest="chat_template", action="store_true",
                   help="wrap each prompt as one user message with the tokenizer's chat template "
                        "(add_generation_prompt=True); for instruction-tuned models")
    p.add_argument("--output-dir", "--output_dir", dest="output_dir", default="data")
    return p


def length_grid(args) -> list[int]:
    """The context lengths of the grid, or a ValueError saying what is impossible."""
    if args.min_context_length < 1 or args.context_interval < 1:
        raise ValueError(f"--min_context_length ({args.min_context_length}) and --context_interval "
                         f"({args.context_interval}) must be >= 1")
    if args.max_context_length < args.min_context_length:
        raise ValueError(f"impossible length grid: --max_context_length {args.max_context_length} < "
                         f"--min_context_length {args.min_context_length}")
    if args.num_samples < 1:
        raise ValueError(f"--num_samples must be >= 1; got {args.num_samples}")
    return list(range(args.min_context_length, args.max_context_length + 1, args.context_interval))


def check_output_dir(path: str) -> None:
    """Before the model loads, so results are never lost at the end."""
    from easy_context.errors import UsageError
    from easy_context.paths import check_writable_dir
    try:
        check_writable_dir(path)
    except UsageError as e:
        raise ValueError(str(e)) from None


def model_tag(path: str) -> str:
    return os.path.basename(os.path.normpath(path)).replace("/", "_") or "model"


# ----------------------------------------------------------------------------------------------
# chat template around token ids
# ----------------------------------------------------------------------------------------------
_SENTINEL = "\uE000EASYCONTEXTPROMPT\uE000"  # private-use chars: never inside a real template


class ChatWrap:
    """``head + content + tail`` where head/tail are the tokenizer's chat template rendered around one user
    message (``add_generation_prompt=True``).

    The prompt's own ids stay untouched (the haystack is tokenized once, as without a template); only the
    template's text around it is tokenized separately, so a token merge across the boundary can differ from
    tokenizing the whole rendered string - harmless for the model, and lengths stay exact.
    """

    def __init__(self, tokenizer):
        if not getattr(tokenizer, "chat_template", None):
            name = getattr(tokenizer, "name_or_path", "") or "the model"
            raise ValueError(f"--chat-template: the tokenizer of {name!r} has no chat template (no 'chat_template' "
                             "in tokenizer_config.json / chat_template.jinja); drop --chat-template for a base model")
        text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False,
                                             add_generation_prompt=True)
        if not isinstance(text, str) or text.count(_SENTINEL) != 1:
            raise ValueError("--chat-template: the chat template does not render the user message verbatim; "
                             "cannot wrap token-id prompts with it")
        head, tail = text.split(_SENTINEL)
        ids = lambda s: list(tokenizer(s, add_special_tokens=False)["input_ids"]) if s else []  # noqa: E731
        self.head, self.tail = ids(head), ids(tail)
        self.bos = tokenizer.bos_token_id

    @property
    def overhead(self) -> int:
        return len(self.head) + len(self.tail)

    def strip_bos(self, ids: list[int]) -> list[int]:
        """The template writes its own BOS (or none): drop the one the tokenizer put in front of the prompt."""
        return ids[1:] if self.bos is not None and ids[:1] == [self.bos] else ids

    def __call__(self, content_ids: list[int], assistant_prefix_ids=()) -> list[int]:
        return self.head + self.strip_bos(list(content_ids)) + self.tail + list(assistant_prefix_ids)


# ----------------------------------------------------------------------------------------------
# model + SP engine + greedy generation
# ----------------------------------------------------------------------------------------------
class EvalSession:
    """Process group, model, tokenizer and the sequence-parallel engine of one eval run."""

    def __init__(self, args):
        from easy_context.inference import SeqParallelLM, init_distributed, load_model
        self.rank, self.world, self.device = init_distributed()
        torch.manual_seed(SEED)
        self.model, self.tok = load_model(args.model, rope_theta=args.rope_theta, device=self.device)
        self.chat = ChatWrap(self.tok) if getattr(args, "chat_template", False) else None
        self.engine = SeqParallelLM(self.model, args.parallel_mode, ring_degree=args.ring_degree)
        # data_parallel: each rank takes every world-th prompt; sp modes: all ranks run every prompt together
        self.dp_split = self.engine.world == 1 and self.world > 1
        eos = self.tok.eos_token_id
        self.eos = eos
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else (eos if eos is not None else 0)

    def mine(self, jobs: list) -> list:
        return [j for i, j in enumerate(jobs) if not self.dp_split or i % self.world == self.rank]

    def generate(self, ids: list[int], max_new_tokens: int) -> str:
        """Greedy continuation of ``ids`` (one prompt), decoded without special tokens."""
        t = torch.tensor([ids], device=self.device)
        new = self.engine.generate(t, max_new_tokens, eos_token_id=self.eos, pad_id=self.pad)
        return self.tok.decode(new, skip_special_tokens=True)

    def gather(self, rows: list, key) -> list:
        """Every rank's rows on every rank, sorted by ``key`` (data_parallel only; sp ranks hold them all)."""
        if not self.dp_split:
            return rows
        gathered = [None] * self.world
        dist.all_gather_object(gathered, rows)
        return sorted((r for part in gathered for r in part), key=key)

    def close(self):
        self.engine.close()


# ----------------------------------------------------------------------------------------------
# atomic outputs: a reader (or a crash) never sees half a file
# ----------------------------------------------------------------------------------------------
def _atomic_write_bytes(path: str, data: bytes) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=d)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def atomic_write_text(path: str, text: str) -> None:
    _atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_csv(path: str, fieldnames: list[str], rows: list[dict]) -> None:
    buf = io.StringIO(newline="")
    w = csv.DictWriter(buf, fieldnames=fieldnames, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
    atomic_write_text(path, buf.getvalue())


def atomic_savefig(fig, path: str) -> None:
    fmt = os.path.splitext(path)[1].lstrip(".") or "png"
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt)
    _atomic_write_bytes(path, buf.getvalue())


__all__ = ["SEED", "add_common_args", "length_grid", "check_output_dir", "model_tag", "ChatWrap", "EvalSession",
           "atomic_write_text", "atomic_write_csv", "atomic_savefig"]
