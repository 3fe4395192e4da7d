"""Offline tools that make what the Engine loads: :mod:`.convert` (the default model folder, ``ortspec convert``),
and the shared-KV drafter's pipeline for ``ortspec train-drafter``: :mod:`.drafter_data` (data from the target),
:mod:`.drafter_graph` (the drafter folder's ONNX graph and metadata), :mod:`.drafter_head` (the head in torch) and
:mod:`.train_drafter` (training and export). The tools build on the engine room (its cache, tokenizer, folders and
target tables); the engine room imports nothing from here."""
