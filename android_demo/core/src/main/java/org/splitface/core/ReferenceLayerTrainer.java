package org.splitface.core;

/** The plain-Java device layer with SGD: same arithmetic as splitface's torch layer and optimiser. */
public final class ReferenceLayerTrainer extends SgdLayerTrainer {
    public ReferenceLayerTrainer(DeviceLayer layer, Sgd sgd) { super(layer, sgd); }

    @Override public float[] forward(float[] images, int n, int h, int w) { return layer.forward(images, n, h, w); }

    @Override public float[][] weightGrads(float[] activationGrad) { return layer.backward(activationGrad); }
}
