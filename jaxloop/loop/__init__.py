"""The host loop and what it composes: periodic actions, the dispatcher of device calls, evaluation,
the Task, the model's identity check, and `run()` itself (its process-wide settings: jaxloop.runtime)."""
