"""tokenloom inside the trainers people run: one small module per framework, each importing its
framework only inside.

The mental model. tokenloom's loader already does what trainers otherwise wrap a DataLoader
for: it shards per rank (and per worker), it batches, and its ``state_dict()`` resumes the very
next batch. So an integration does two things only: it keeps the framework from re-sharding,
re-batching or skipping batches on resume, and it puts the loader's own state into the
framework's own checkpoint, taken at the batch the training step last consumed.

| framework | what to write | the loader's state rides in |
|---|---|---|
| Accelerate | ``accelerator.prepare(loader)`` (kept as it is; see `accelerate`) | ``save_state``'s folder (``dl_state_dict.bin``) |
| Hugging Face Trainer | ``TokenLoomTrainer(model, args, train_loader=loader)`` (`hf`) | ``checkpoint-N/tokenloom_loader_rank<r>.json`` |
| PyTorch Lightning | ``trainer.fit(model, datamodule=TokenLoomDataModule(loader))`` (`lightning`; `pytorch_lightning` for that package), or the loader as ``train_dataloader()`` | the ``.ckpt`` (the datamodule's or the loop's entry) |
| torchtitan | ``TitanLoader(loader, dp_rank, dp_world_size)`` (`torchtitan`) | DCP, one entry per data-parallel rank |
"""
