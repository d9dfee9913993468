"""The trainer: RL, SFT and distillation training of the policy, weight publishing, checkpoints and exports.
Its configs are ``primerl.configs.trainer``; its batches are packed by ``primerl.proto.packing``.

Daemons and their set-up:
    runner          the RL trainer daemon (``primerl-trainer``): fetch, step, publish, checkpoint, commit
    sft_runner      ``primerl sft``: supervised fine-tuning from a JSONL file, without the broker
    training_setup  what both build alike: model, optimizer, schedule, step function, resume, checkpoint save
    step_io         the RL trainer's fetch and IO threads (the compute loop only computes)
    distributed     torch.distributed: ranks, DDP / FSDP2 wrapping, collectives

Training:
    model           load the model (activation checkpointing, LoRA)
    optim           optimizer and learning-rate schedule
    batch           ``MicroBatch``: one packed micro-batch as tensors
    losses          RL, SFT and distillation losses
    train_step      one optimizer step over a step's micro-batches
    sft_data        SFT samples: read, tokenize, pack

The weights out of the trainer:
    hf_state_dict   the model's tensors as Hugging Face / peft save them (a LoRA model merged): published and
                    exported alike
    publish         ``PolicyPublisher``: each step's policy to the broker (FULL, LORA or DELTA)
    update_builder  builds each update from the model and keeps the base of the next delta
    prepared_update a built update and the memory its payload lies in (pooled buffers, shared-memory segments)
    payload_writer  FULL payloads written into reused buffers
    payload_stream  a FULL payload sent while it is still being written
    weights_export  ``weights/step_N``: a Hugging Face model directory
    checkpoint      checkpoints of model, optimizer, scheduler, RNG and progress
    committed_dir   directories that appear whole (temp + ``STABLE`` + rename)

    tiny_model      the tiny model tests and demos train (``primerl init-tiny-model``)
    tiny_families   the model families it builds (``--family``) and those this machine cannot serve
    tiny_chat_formats  the families' chat templates and turn markers
"""
