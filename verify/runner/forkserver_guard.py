"""Imported only by the multiprocessing forkserver (a preload module of the gang): the forkserver
dies with the harness process that started it, by a parent-death signal, instead of lingering until
it notices its pipe closed. Importing it anywhere else would tie that process to its parent too."""
import signal

from verify.runner.isolation import PR_SET_PDEATHSIG, prctl

prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
