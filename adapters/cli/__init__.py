"""The ``ortspec`` command line: :mod:`.main` (the parser and ``main``, the console script), :mod:`.options` (the
shared argument types and option groups), :mod:`.engine_args` (from parsed options to an Engine), and one module
per command (:mod:`.demo`, :mod:`.generate`, :mod:`.bench`, :mod:`.convert`, :mod:`.train_drafter`, :mod:`.serve`,
:mod:`.batch`)."""
