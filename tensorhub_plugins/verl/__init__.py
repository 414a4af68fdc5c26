"""TensorHub for verl: a checkpoint engine (`checkpoint_engine.py`)."""
