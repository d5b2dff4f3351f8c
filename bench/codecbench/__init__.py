"""The parts of ``bench/codec.py``, the codec benchmark (run that file, not this package).

- :mod:`.documents`: the held-out documents it runs on;
- :mod:`.measure`: real containers and kernels, timed, and the quality of every row;
- :mod:`.estimates`: the entropy-estimated baselines and ablations;
- :mod:`.triton_decode`: the Triton GPU decoder's throughput on synthetic streams;
- :mod:`.report`: means, targets, the tables, the JSON result and the plot;
- :mod:`.log`: progress and warnings on stderr.
"""
