"""Exercise checks, one module per lab; each registers its exercises with mhc_lab.course.checks."""
