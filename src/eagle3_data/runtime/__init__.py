"""The run's machinery: the `eagle3-data run` launcher, the live view, process ownership and the pre-run
check. Stages never import it at module level; it holds no stage logic."""
