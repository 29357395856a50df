"""The mutant zoo: broken runners, each with one realistic graph-mode bug, that the harness must
fail with the check named in `zoo.MUTANTS`."""
