"""Offline tools that make what the Engine loads: :mod:`.convert` (the default model folder, ``ortspec convert``),
and the shared-KV drafter's pipeline for ``ortspec train-drafter``: :mod:`.drafter_data` (data from the target),
:mod:`.target_tables` (the target's embedding and RoPE tables), :mod:`.drafter_graph` (the drafter folder's ONNX
graph and metadata), :mod:`.drafter_head` (the head in torch) and :mod:`.train_drafter` (training and export);
:mod:`.folders`: how a finished folder replaces the one at its destination."""
