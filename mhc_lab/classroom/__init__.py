"""The classroom: build the student notebooks, run the course, grade submissions, hand out variants, check a
machine, and the ``mhc-lab`` command line that does each."""
