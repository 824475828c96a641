"""The step and what runs on it: engine, sampling, generation, evaluation."""
