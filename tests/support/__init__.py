"""Test support, not shipped: model folders built on the fly (:mod:`.models`: tiny and random-weight Llamas;
:mod:`.architectures`: a tiny model of every architecture the builder writes; :mod:`.drafters`: random shared-KV
drafters) and :mod:`.conformance` (``check_folder``: does ortspec serve a folder exactly; ``GreedyReplay``).

Imported as ``tests.support`` from the repository root: by the tests (``tests/conftest.py`` puts the root on
``sys.path``), by ``python -m bench...`` and by the scripts (which put the root on ``sys.path`` too)."""
