package org.splitface.demo;

import android.graphics.Bitmap;
import android.graphics.BitmapFactory;
import java.io.File;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.List;
import org.splitface.core.AppRun;

/** faces/<identity>/<image>.jpg on the phone: centre crop 160 px, resize, CHW floats in [0, 1] (as splitface.common.data). */
final class FaceFolder implements AppRun.Faces {
    final List<File> images = new ArrayList<>();
    final List<Integer> labels = new ArrayList<>();

    /** `classes` fixes each identity's label index (the server's classifier order). */
    FaceFolder(File root, List<String> classes) {
        for (int label = 0; label < classes.size(); label++) {
            File[] files = new File(root, classes.get(label)).listFiles();
            if (files == null) continue;
            Arrays.sort(files);
            for (File f : files) {
                String name = f.getName().toLowerCase();
                if (name.endsWith(".jpg") || name.endsWith(".jpeg") || name.endsWith(".png")) { images.add(f); labels.add(label); }
            }
        }
        if (images.isEmpty()) throw new IllegalArgumentException("no face images under " + root + " for the configured classes");
    }

    @Override public int count() { return images.size(); }

    @Override public int label(int index) { return labels.get(index); }

    @Override public float[] image(int index, int size) {
        Bitmap full = BitmapFactory.decodeFile(images.get(index).getPath());
        int crop = Math.min(160, Math.min(full.getWidth(), full.getHeight()));
        Bitmap centre = Bitmap.createBitmap(full, (full.getWidth() - crop) / 2, (full.getHeight() - crop) / 2, crop, crop);
        Bitmap small = Bitmap.createScaledBitmap(centre, size, size, true);
        int[] argb = new int[size * size];
        small.getPixels(argb, 0, size, 0, 0, size, size);
        float[] chw = new float[3 * size * size];
        for (int i = 0; i < argb.length; i++) {
            chw[i] = ((argb[i] >> 16) & 0xff) / 255f;
            chw[size * size + i] = ((argb[i] >> 8) & 0xff) / 255f;
            chw[2 * size * size + i] = (argb[i] & 0xff) / 255f;
        }
        return chw;
    }
}
