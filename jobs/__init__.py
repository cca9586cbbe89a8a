"""Entry points: the `dejaq` CLI and the spark-submit jobs. Thin: the work is in pipelines/."""
