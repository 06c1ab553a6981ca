"""Running a whole run: the supervisor and follower, progress, the reward curve, step replay."""
