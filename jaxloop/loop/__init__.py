"""The host loop and what it composes: periodic actions, the dispatcher of device calls, evaluation,
the Task, the model's identity check, the process-wide setup of a run, and `run()` itself."""
