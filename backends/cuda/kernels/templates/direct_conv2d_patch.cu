    // the pool window's conv positions read one ${R}x$C input patch per input channel: load it
    // once into registers, then accumulate every position from there
    const int ch0 = oh * $PSH - $PPH, cw0 = ow * $PSW - $PPW;
    const int ih0 = ch0 * $SH - $PH, iw0 = cw0 * $SW - $PW;
    float sum[$PKH][$PKW][$COT];
#pragma unroll
    for (int a = 0; a < $PKH; ++a)
#pragma unroll
      for (int b = 0; b < $PKW; ++b)
#pragma unroll
        for (int j = 0; j < $COT; ++j) sum[a][b][j] = 0.f;
    for (int ci = $ci0; ci < $CI; ci += $cistep) {
      float xp[$R][$C];
#pragma unroll
      for (int r = 0; r < $R; ++r) {
        const int ih = ih0 + r;
        const bool rok = ih >= 0 && ih < H;
#pragma unroll
        for (int c = 0; c < $C; ++c) {
          const int iw = iw0 + c;
          xp[r][c] = rok && iw >= 0 && iw < W ? fx_to_f32(x[$x_at]) : 0.f;
        }
      }
#pragma unroll
      for (int kh = 0; kh < $KH; ++kh)
#pragma unroll
        for (int kw = 0; kw < $KW; ++kw) {
          const float* wr = ws + (ci * $KH + kh) * $KW + kw;
#pragma unroll
          for (int j = 0; j < $COT; ++j) {
            const float wv = wr[j * $CIKK];
#pragma unroll
            for (int a = 0; a < $PKH; ++a)
#pragma unroll
              for (int b = 0; b < $PKW; ++b) sum[a][b][j] += xp[a * $SH + kh * $DH][b * $SW + kw * $DW] * wv;
          }
        }
    }
$reduce_patch
    float best[$COT];
#pragma unroll
    for (int j = 0; j < $COT; ++j) best[j] = (-__int_as_float(0x7f800000));
#pragma unroll
    for (int a = 0; a < $PKH; ++a) {
      const int ch = ch0 + a;
      if (ch < 0 || ch >= CH) continue;
#pragma unroll
      for (int b = 0; b < $PKW; ++b) {
        const int cw = cw0 + b;
        if (cw < 0 || cw >= CW) continue;
#pragma unroll
        for (int j = 0; j < $COT; ++j) {
          const int co = co0 + j;
          if (co >= $CO) break;
          float acc = sum[a][b][j];
$epilogue
          if (acc > best[j] || acc != acc) best[j] = acc;
        }
      }
    }
