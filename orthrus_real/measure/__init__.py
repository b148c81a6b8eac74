"""The measuring commands: ``bench`` (drive a server with a scenario's workload), ``calibrate``
(profile an engine and fit the cost model) and ``validate`` (the simulator's predictions against
measured runs). The top floor below the command line: it may use every other room."""
