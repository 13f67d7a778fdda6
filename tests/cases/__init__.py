"""What the tests share: input builders and checks (``helpers``), and the rank bodies that run in rank processes
(``mp``, ``ll``, ``internode``, ``sched``, ...), imported as ``from tests.cases import mp``.

``tests`` is a namespace package on the repository root, which ``tests/conftest.py`` puts on ``sys.path``; rank
processes get that path from the test process (``spawn`` hands ``sys.path`` over, and
``triton_ep.testing.start_forkserver`` passes it to the fork server as ``PYTHONPATH``), so a rank function
pickled as ``tests.cases.mp.<name>`` imports there too."""
