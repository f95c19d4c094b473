"""Our CPU operator: C++ sources built on first use into one library (``kernels.py`` builds and
loads it), and the Python side that calls it. The code that lays a model's weights out for it
lives in ``model/`` (``model/cpu_decode.py``): ``model`` uses ``ml``, never the reverse."""
