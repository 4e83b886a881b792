"""Starting a run's processes and joining them: the elastic launcher and the in-place
launchers (launch), the one-machine rendezvous, the process group (distributed) and the
stop signals (preemption)."""
