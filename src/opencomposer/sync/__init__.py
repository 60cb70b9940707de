"""Weight sync: the trainer publishes each version as the differences from the last to a
store (a directory or S3); inference workers follow the store and apply new versions in
flight, between two engine steps.

* ``codec.py``       one tensor, exactly: same / sparse (changed positions) / xor / raw
* ``store.py``       ``FileStore``, ``S3Store``, ``open_store(uri)``
* ``layout.py``      keys of versions, timelines and ranks; which versions are complete
* ``publisher.py``   ``WeightPublisher.publish(state_dict, version)`` (trainer side)
* ``subscriber.py``  ``WeightSubscriber.poll(engine)``, ``WeightFollower`` (inference side)
* ``model_delta.py`` a safetensors file as its exact difference from a reference model (what
  crosses a narrow link when both ends can make the reference)
"""
