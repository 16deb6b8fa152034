"""How processes start and stop, apart from the parallel layouts: the world a job runs in, local or started by
torchrun/srun, and where its ranks meet (`world`); N local ranks in one world (`spawn`: the local launcher, the
tests, conversion, evaluation, the reshard check; its fork server's last import, `preloaded`, freezes what it
imported); how ranks that failed are told, in one line and failure.log (`failures`); stop signals noted by every
rank (`signals`) and the run directory's lock (`runlock`); a rank ending with the process that started it
(`lifeline`); standard output that survives a hung-up terminal (`console`); ending a command's process without the
interpreter's teardown (`exit`). Imports nothing above `parallel`: a rank's role, or a config error, is the caller's
to add. What takes a job's config to the RL loop on every rank is
`controller/train.py`."""
