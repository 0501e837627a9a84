package org.splitface.core;

/** The plain-Java device layer with SGD: same arithmetic as device_sdk's torch layer and optimiser. */
public final class ReferenceLayerTrainer implements LayerTrainer {
    public final DeviceLayer layer;
    public final Sgd sgd;

    public ReferenceLayerTrainer(DeviceLayer layer, Sgd sgd) { this.layer = layer; this.sgd = sgd; }

    @Override public int[] outputShape(int n, int h, int w) { return layer.outputShape(n, h, w); }

    @Override public float[] forward(float[] images, int n, int h, int w) { return layer.forward(images, n, h, w); }

    @Override public float[][] weightGrads(float[] activationGrad) { return layer.backward(activationGrad); }

    @Override public void step(float[] activationGrad) { sgd.step(weightGrads(activationGrad)); }

    @Override public Object snapshot() { return new Object[] {layer.state(), sgd.state()}; }

    @Override public void restore(Object snapshot) {
        Object[] s = (Object[]) snapshot;
        layer.load((float[][]) s[0]);
        sgd.load((Object[]) s[1]);
    }
}
