"""SplitRL trainer service: data, losses, learner, checkpoints, weight publishing."""
