"""An example of your own model, data (examples/own-model.yaml) and compressor (codecs.py) for commlab: any
package on PYTHONPATH."""
