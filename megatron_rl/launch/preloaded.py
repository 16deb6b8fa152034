"""Imported last by the fork server (`spawn._PRELOAD`, after the modules it preloads), and nowhere else: its import
moves every object the server has imported out of the garbage collector's reach (`gc.freeze()`).

Importing it is its whole purpose; it is the one hook Python's fork server offers to run code after its preloads.
Why: a rank forked from the server first re-runs the parent's main module (multiprocessing's `prepare`), and the
allocations there can trigger a full collection over everything the server imported (torch, Megatron-Core, the job's
modules), 2-3 s per rank on a loaded 2-core machine before its first heartbeat, depending on where the server's
collection counters happened to stand. Frozen, those objects are never re-read by a collection, in the server or in
any rank it forks; they live as long as the process anyway, so nothing that would be freed is kept.
"""
import gc

gc.freeze()
