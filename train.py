#!/usr/bin/env python
"""Long-context fine-tuning of a Hugging Face causal LM with sequence parallelism (EasyContext's train.py).

    # one node, 8 GPUs, DeepSpeed ZeRO-3 offload, bf16 (the sequence spread over all 8 GPUs)
    accelerate launch --config_file accelerate_configs/single_node.yaml train.py \
        --model meta-llama/Llama-2-7b-hf --dataset DATA --seq-length 256000 --rope-theta 1e7 \
        --parallel_mode zigzag_ring_attn --gradient-accumulate-every 4 --output-dir output/stage3
    # two nodes: the same on each node, plus --machine_rank N --main_process_ip HOST; --sp-size 8 keeps
    # each sequence inside a node (dp 2 x sp 8)
    accelerate launch --config_file accelerate_configs/two_node.yaml --machine_rank 0 \
        --main_process_ip HOST --main_process_port 29500 train.py --sp-size 8 ...
    # CPU: 2 processes (gloo), ZeRO-3, float32 (`make demo`); or `python train.py ...` (1 process)
    accelerate launch --config_file accelerate_configs/cpu.yaml train.py --model TINY --dataset DATA \
        --seq-length 256 --output-dir out

Processes form data-parallel (dp) x sequence-parallel (sp) groups: the ranks of one sp group hold
shards of the same packed rows (`--batch-size` rows per micro-batch), different sp groups read
different rows. One optimizer step = `--gradient-accumulate-every` micro-batches. The loss is the
token mean over the whole window (all ranks, all micro-batches): each rank backpropagates
sum(local NLL) * world * GA / N_window, which undoes the 1/world gradient average and the 1/GA loss
scaling of DeepSpeed/Accelerate, so the gradient is that of the global token-mean loss.
Logic lives in easy_context_train; this file is the readable outline.
"""
import math
import time

from easy_context_train.args import parse_args
from easy_context_train.errors import UsageError, fail
from easy_context_train.faults import Guard, handle_fault
from easy_context_train.op_build import watch_op_builds
from easy_context_train.run_dir import exit_with_parent
from easy_context_train.session import already_final


def main(argv=None):
    args = parse_args(argv)  # one-line errors for bad flags, before heavy imports
    exit_with_parent()  # a killed launcher never leaves ranks training
    watch_op_builds(args.build_lock_timeout)  # start-up: a stale DeepSpeed op-build lock is one line (exit 5)
    try:
        # the output dir's state (run_state.py), every rank alike: --resume of a finished run is a no-op (one line,
        # exit 0), refused (fewer steps) or continued from its final step
        if not already_final(args):
            train(args)
    except UsageError as e:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()  # a clean exit code instead of a gloo abort
        fail(str(e), code=getattr(e, "code", 2))
    except Exception as e:  # out of memory, a lost rank, a failed checkpoint write: one line + exit status (faults.py)
        handle_fault(e, args)


def train(args):
    import torch
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    from easy_context import apply_seq_parallel_monkey_patch
    from easy_context.hf.route import check_config_routable
    from easy_context_train import checkpoint as ckpt
    from easy_context_train.data import data_identity, forever, load_any_dataset, make_loader, validate_packed
    from easy_context_train.evaluate import due, eval_loss, load_eval_rows
    from easy_context_train.lora import apply_lora
    from easy_context_train.metrics import JsonlLog, StepMetrics, report
    from easy_context_train.modeling import (apply_memory_options, count_params, get_rope_theta, load_config,
                                                load_model, load_tokenizer)
    from easy_context_train.optim import build_optimizer, configure_deepspeed, current_lr
    from easy_context_train.plan_ahead import PlannedBatches
    from easy_context_train.moe import aux_coef, aux_term
    from easy_context.loss import IGNORE_INDEX, global_sum
    from easy_context_train.parallel import build_layout, make_accelerator, nll_sum
    from easy_context_train.session import open_run, resume, save_outputs
    from easy_context_train.writes import agree

    # 1. Inputs: a missing model, a missing column or short rows fail here, before any process group.
    config = load_config(args.model, args.rope_theta, args)  # strict (a missing width / heads / vocab) + --rope-scaling
    try:  # a layer the patch cannot route: one line, before any collective
        check_config_routable(config, args.parallel_mode)
    except ValueError as e:
        raise UsageError(str(e)) from None
    moe_coef = aux_coef(config, args)  # MoE router load-balancing loss (0 = off)
    if args.save_rope_theta is None:  # the theta trained with (the model's own when --rope-theta is unset)
        args.save_rope_theta = get_rope_theta(config)
    data = validate_packed(load_any_dataset(args.dataset, args.dataset_split), args.dataset, args.seq_length,
                           config.vocab_size, args.model)  # + ids inside the vocabulary, something to learn

    eval_rows = load_eval_rows(args, config.vocab_size)  # --eval-dataset: validated like --dataset
    accelerator = make_accelerator(args)  # gloo on CPU, nccl on GPU
    layout = build_layout(args.parallel_mode, args.sp_size, args.ring_degree, args.seq_length, config)  # dp x sp
    lock, run_id = open_run(args, accelerator, config, data_identity(data))  # one run at a time; --resume checks
    # the flags and what the data is
    set_seed(args.seed)

    # 2. Model: attention through the sp group, memory options, optimizer whose LR is --learning-rate.
    # DeepSpeed bf16 keeps fp32 master weights in its optimizer; plain Accelerate autocasts fp32 weights.
    ds_bf16 = accelerator.state.deepspeed_plugin is not None and accelerator.mixed_precision == "bf16"
    dtype = torch.bfloat16 if ds_bf16 else torch.float32
    model = load_model(args.model, config, dtype)
    tokenizer = load_tokenizer(args.model)
    n_params = count_params(model)
    if layout.mode.is_parallel:
        try:
            layout.check_heads(config.num_attention_heads, getattr(config, "num_key_value_heads", None))
        except ValueError as e:
            raise UsageError(str(e)) from None
    apply_seq_parallel_monkey_patch(model, layout)  # data_parallel: plain attention; hybrids reset state per document
    apply_memory_options(model, args, layout, accelerator)  # --checkpointing auto: budgets agreed over ranks
    model = apply_lora(model, args)  # --lora-rank: PEFT adapters around the patched base (base frozen)
    use_ds = configure_deepspeed(accelerator, args)
    optimizer, scheduler = build_optimizer(model, args, use_ds)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    unwrapped = accelerator.unwrap_model(model)
    if not use_ds:
        accelerator.register_for_checkpointing(scheduler)

    loader = make_loader(data, layout, args.batch_size, args.seq_length, args.seed, accelerator,
                         balance=args.dp_balance)  # --dp-balance: even sum(L^2) over dp ranks

    # 3. Resume: model, optimizer, scheduler, RNG and data position from the latest checkpoint.
    start = resume(args, accelerator, loader, run_id)

    GA = args.gradient_accumulate_every
    batches = PlannedBatches(forever(loader), loader, layout, GA)  # packed rows: next step's dispatch planned meanwhile
    tokens_per_step = args.batch_size * GA * args.seq_length * layout.dp
    measure = StepMetrics(n_params, config, args.seq_length, accelerator.num_processes, tokens_per_step)
    log = JsonlLog(args.log_file, accelerator.is_main_process, start)  # every write: the guarded writer (exit 74)
    agree(accelerator, log.failed)
    accelerator.print(f"{layout.mode.name} {layout}: {n_params / 1e6:.1f}M params, {tokens_per_step} tokens/step, "
                      f"{'DeepSpeed' if use_ds else 'Accelerate'}; lr {args.learning_rate:g}"
                      + (f"; LoRA rank {args.lora_rank}" if args.lora_rank else ""))
    bar = tqdm(total=args.max_train_steps, initial=start, disable=not accelerator.is_local_main_process,
               desc="train", dynamic_ncols=True)
    model.train()
    guard = Guard(args, accelerator, model)  # SIGTERM/SIGUSR1 -> checkpoint + exit 75; a silent rank -> exit 4

    # 4. Train.
    for step in range(start, args.max_train_steps):
        t0 = time.perf_counter()
        lr = current_lr(model, optimizer)  # the LR this step's update uses
        window = []  # this step's micro-batches, sharded for this sp rank (targets = next tokens)
        for _ in range(GA):
            inp, pos, tgt, table = next(batches)  # optional labels / packed-document positions (+ their dispatch)
            window.append(layout.prepare_inputs(inp.cpu(), pos.cpu(), tgt.cpu(), accelerator.device, dispatch=table))
        n_tokens = global_sum(sum((w["local_target_ids"] != IGNORE_INDEX).sum() for w in window).float()
                              .to(accelerator.device))
        if step == start and n_tokens.item() == 0:  # the same on every rank: all refuse before a step of nothing
            raise UsageError(f"the first step's {GA * args.batch_size * layout.dp} rows have no trainable label (every "
                             "target is -100): nothing to learn; a chat template without assistant markers gives "
                             "this; check the 'labels' column of --dataset")
        n_tokens = n_tokens.clamp(min=1)
        scale = accelerator.num_processes * GA / n_tokens
        nll_window, aux_window = torch.zeros((), device=accelerator.device), 0.0
        for w in window:
            with accelerator.accumulate(model):
                router = [] if moe_coef else None
                nll = nll_sum(model, unwrapped, w["local_input_ids"], w["local_position_ids"],
                              w["local_target_ids"], args.chunked_loss, router, w.model_kwargs)
                aux, aux_val = aux_term(router, config, moe_coef, accelerator.num_processes)
                accelerator.backward(nll * scale + aux)  # DeepSpeed steps its optimizer + scheduler at the boundary
                aux_window += aux_val / GA
                nll_window += nll.detach().float()
                if accelerator.sync_gradients and not use_ds:
                    if args.max_grad_norm > 0:
                        accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
        loss = (global_sum(nll_window) / n_tokens).item()  # token mean over the window, all ranks
        if not math.isfinite(loss):  # the same value on every rank: all stop, nothing is saved
            raise UsageError(f"the loss is {loss} at step {step + 1}: stopping without saving (lower "
                             "--learning-rate, check the data, or resume from the last checkpoint)", code=1)
        row = {"step": step + 1, "loss": loss, "lr": lr, **measure(time.perf_counter() - t0)}
        row.update({"router_aux_loss": aux_window} if moe_coef else {})
        if due(args, step + 1):  # held-out token-mean loss, same sp layout (after the timing above)
            row["eval_loss"] = eval_loss(model, unwrapped, eval_rows, layout, args, accelerator.device)
        report(row, log, bar, accelerator, args.wandb)
        preempted = guard.stop_requested(step + 1, log.failed)  # a signal or a failed write on any rank (one
        # all-reduce): all save and exit 75, or all exit 74. The last step is checkpointed too: the state a finished
        # run continues from (--resume with a larger --max-train-steps; run_state.py)
        if preempted or (args.checkpoint_every and ((step + 1) % args.checkpoint_every == 0
                                                    or step + 1 == args.max_train_steps)):
            ckpt.save_checkpoint(accelerator, args.output_dir, step + 1, args.keep_checkpoints,
                                 {"data": batches.state_dict()}, run_id=run_id)
        ckpt.crash_point("step", step + 1)  # no-op unless the tests ask for a crash
        guard.exit_if(preempted, step + 1)
    bar.close()
    batches.close()

    # 5. Final model: HF safetensors + tokenizer (or the LoRA adapter), RoPE theta (--save-rope-theta) in config.json.
    save_outputs(args, accelerator, model, tokenizer, args.max_train_steps)  # + run.json: finished at this step
    lock.release()
    guard.complete(args.max_train_steps)  # exit 0; a signal from here on is acknowledged (the model is complete)


if __name__ == "__main__":
    main()
