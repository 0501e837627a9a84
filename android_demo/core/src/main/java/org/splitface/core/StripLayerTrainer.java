package org.splitface.core;

import java.nio.file.Files;
import java.nio.file.Path;

/**
 * The device layer on the strip programs (release_strip.pte and vjp_strip.pte, `splitface.export.artifacts.write_strip_ptes`)
 * through the native runner's strip layer in C++ (libsplitface_jni, loaded by {@link NativeProgram#loadLibrary}):
 * each image is cut into strips of a few rows whose every intermediate stays in the core's cache, so a batch never
 * holds more than one strip's activations besides its release. The weights and SGD are here, in Java; the programs
 * take the weights as inputs, so each step's weights are the ones used. Any batch size; the image height a multiple
 * of the strip's rows and its width the programs'. Bad shapes throw {@link IllegalArgumentException} by name. One
 * call at a time (the strip layer's buffers are shared), and {@link #close} waits for a call in progress.
 */
public final class StripLayerTrainer extends SgdLayerTrainer implements AutoCloseable {
    private long handle;
    private float[] lastImages;
    private int lastN, lastH, lastW;

    public StripLayerTrainer(Path releasePte, Path gradPte, DeviceLayer layer, Sgd sgd) {
        super(layer, sgd);
        for (Path p : new Path[] {releasePte, gradPte})
            if (!Files.isRegularFile(p)) throw new IllegalArgumentException("no program at " + p);
        if (layer.bias == null) throw new IllegalArgumentException("the strip programs take a conv with a bias");
        handle = load(releasePte.toAbsolutePath().toString(), gradPte.toAbsolutePath().toString());
    }

    /** {C, O, rows, width, kh, kw}: the programs' channels in and out, the strip's rows, the width, the kernel. */
    public synchronized int[] geometry() { return geometry(live()); }

    @Override public synchronized float[] forward(float[] images, int n, int h, int w) {
        float[] out = release(live(), images, n, h, w, weights());   // noise is added by the DeviceClient
        lastImages = images; lastN = n; lastH = h; lastW = w;
        return out;
    }

    /** The weight and bias gradients of the last forward's images given the server's gradient. */
    @Override public synchronized float[][] weightGrads(float[] activationGrad) {
        if (lastImages == null) throw new IllegalStateException("weightGrads before any forward");
        return grads(live(), lastImages, lastN, lastH, lastW, activationGrad, weights());
    }

    @Override public synchronized void close() {
        if (handle != 0) free(handle);
        handle = 0;
    }

    private float[][] weights() { return new float[][] {layer.weight, layer.bias}; }

    private long live() {
        if (handle == 0) throw new IllegalStateException("the strip layer is closed");
        return handle;
    }

    private static native long load(String releasePte, String gradPte);
    private static native int[] geometry(long handle);
    private static native float[] release(long handle, float[] images, int n, int h, int w, float[][] weights);
    private static native float[][] grads(long handle, float[] images, int n, int h, int w, float[] grad, float[][] weights);
    private static native void free(long handle);
}
