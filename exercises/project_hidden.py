"""The grader's hidden workload for the scheduling project (instructor only: a student release leaves it out)."""
SEED = 20261205
