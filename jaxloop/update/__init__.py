"""One update: schedules, the optimizer chain, the train state and the pure
train_step, its memory plan and its sharding over devices."""
