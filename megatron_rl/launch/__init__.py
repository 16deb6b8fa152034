"""How processes start and stop, apart from the parallel layouts: N local ranks in one world (`spawn`: the local
launcher, the tests, conversion, evaluation, the reshard check), stop signals noted by every rank (`signals`) and
the run directory's lock (`runlock`). Imports nothing above `parallel`; the launcher that takes a job's config to
the RL loop is `controller/launcher.py`."""
