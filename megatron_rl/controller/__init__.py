"""The single controller: executors in one world, the (a)synchronous schedule, the default job."""
