"""Starting a run: the train command, the launcher that forks the ranks, each rank's process
(failure records, the run lock, the hang watchdog, the startup clock) and ``paratron info``."""
